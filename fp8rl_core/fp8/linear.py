"""`Fp8Linear`: a drop-in `nn.Linear` whose forward and backward GEMMs run in blockwise FP8.

Recipe (Transformer Engine's Float8BlockScaling, DeepSeek-V3 section 3.3), X [M, K], W [N, K], dY [M, N]:
    forward  Y  = Q(X)[1,128] . Q(W)[128,128]^T                     + b      (K contracted)
    dgrad    dX = Q(dY)[1,128] . Q(W)^T          (W's [128,128] grid transposed; N contracted)
    wgrad    dW = Q(dY^T)[1,128] . Q(X^T)[1,128]^T   i.e. dY and X re-quantized in [128, 1] blocks
                                                 (along tokens) from their high-precision copies
    db       = sum_tokens dY                                        (FP32)
Every GEMM accumulates in FP32 (see gemm.py). dX follows X's dtype, dW and db the parameters' dtype.

Formats (`quant=Quantization(format, scale_format, check_finite)`, quantization.py: the layer's one
configuration; formats.py lists the formats): block128 (above, the default: this module's own path,
executors and fused CPU kernels) or tensorwise / mxfp8 / nvfp4, whose forward, dgrad and wgrad run through
lowp.py with that format's kernel module choosing the block of each operand (module docstrings there);
their Q(W) holds what fprop and dgrad contract (MXFP8: a rowwise and a columnwise copy), cached like
block128's.

Quantization source (`fp8.quantize_from`): with `quantize_dtype=torch.bfloat16` Q(W) quantizes the BF16
rounding of the master weight, the very tensor a refit sends the generation engine and the one a
Megatron-Core + Transformer Engine trainer with BF16 parameters quantizes (its FP32 master lives in the
optimizer); None quantizes the parameter as stored (the FP32 master: a different recipe, xtuner #2044).

Q(W) is computed once per weight value, not per forward: `Fp8Linear` caches it, keyed on the
Parameter's version counter and storage, and on a process-wide count of optimizer steps (any
`torch.optim` optimizer, through a global step hook), so the old-log-prob pass, every micro-batch and
the backward of one optimizer step share one quantization; either signal invalidates it (an
optimizer's in-place update, `load_state_dict`'s copy_, a new tensor). A write that bypasses both
(`weight.data.copy_` outside an optimizer) needs `Fp8Linear.invalidate()`. FP8RL_WEIGHT_CACHE=0 turns
the cache off. Same bits either way: the cached value is the quantization of the same tensor.

Autocast: the layer computes its own precision, so autocast is disabled inside the GEMMs. Under an
enabled autocast (CPU or CUDA) the input is first cast to the autocast dtype (bf16), so the output
dtype is what `nn.Linear` would return under the same autocast.
"""
from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from fp8rl_core.fp8 import lowp
from fp8rl_core.fp8.formats import resolve_scale_format
from fp8rl_core.fp8.functional import (
    ACT_BLOCK,
    COL_BLOCK,
    Fp8Weight,
    linear_from_operands,
    quantize_operand,
    quantize_weight,
)
from fp8rl_core.fp8.gemm import scaled_mm
from fp8rl_core.fp8.quantization import BLOCK128, Quantization

_optimizer_steps = 0  # every optimizer step in this process, counted by the hook below


def _count_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_step)


def weight_cache_enabled() -> bool:
    return os.environ.get("FP8RL_WEIGHT_CACHE", "1") not in ("0", "false", "False", "")


def _grad_input(dy2: torch.Tensor, w: Fp8Weight, power_of_two: bool, check_finite: bool,
                out_dtype: torch.dtype) -> torch.Tensor:
    """dX [M, K] = Q(dY)[1,128] . Q(W) in FP32, cast once to out_dtype: B = W^T [K, N], W's [128,128]
    grid transposed."""
    dy_op = quantize_operand(dy2, ACT_BLOCK, power_of_two=power_of_two, check_finite=check_finite, name="grad_output")
    return scaled_mm(dy_op, w.operand().t(), out_dtype=out_dtype)


def _grad_weight(dy2: torch.Tensor, x2: torch.Tensor, power_of_two: bool, check_finite: bool) -> torch.Tensor:
    """dW [N, K] = dY^T X over tokens M; dY [M, N] and X [M, K] re-quantized in [128, 1] blocks (along M)."""
    dy_op = quantize_operand(dy2, COL_BLOCK, power_of_two=power_of_two, check_finite=check_finite, name="grad_output")
    x_op = quantize_operand(x2, COL_BLOCK, power_of_two=power_of_two, check_finite=check_finite, name="x")
    return scaled_mm(dy_op.t(), x_op.t(), out_dtype=torch.float32)  # [N, M] (1,128) x [K, M] (1,128)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, w: Fp8Weight, power_of_two: bool, check_finite: bool):  # type: ignore[override]
        """w: Q(weight) without bias (Fp8Linear.quantized_weight); weight itself is here for its grad."""
        x2 = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            x_op = quantize_operand(x2, ACT_BLOCK, power_of_two=power_of_two, check_finite=check_finite, name="x")
            b = None if bias is None else bias.detach()
            y = linear_from_operands(x_op, dataclasses.replace(w, bias=b), x.dtype)
        ctx.w = w  # quantized copies, not parameters: no version-counter checks needed
        ctx.save_for_backward(x2)
        ctx.meta = (x.shape, weight.dtype, power_of_two, check_finite)
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x2,) = ctx.saved_tensors
        x_shape, w_dtype, power_of_two, check_finite = ctx.meta
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = _grad_input(dy2, ctx.w, power_of_two, check_finite, x2.dtype).reshape(x_shape)
            if ctx.needs_input_grad[1]:
                dw = _grad_weight(dy2, x2, power_of_two, check_finite).to(w_dtype)
            if ctx.needs_input_grad[2]:
                db = dy2.float().sum(0).to(w_dtype)
        return dx, dw, db, None, None, None


class _LowpLinearFn(torch.autograd.Function):
    """Fp8Linear's forward and backward for the formats of lowp.py (everything but block128)."""

    @staticmethod
    def forward(ctx, x, weight, bias, w: lowp.QuantWeight, check_finite: bool):  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            y = lowp.forward(x2, w, check_finite=check_finite)
            if bias is not None:
                y += bias.detach().to(torch.float32)
        ctx.w = w
        ctx.save_for_backward(x2)
        ctx.meta = (x.shape, weight.dtype, check_finite)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        (x2,) = ctx.saved_tensors
        x_shape, w_dtype, check_finite = ctx.meta
        w: lowp.QuantWeight = ctx.w
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dx = lowp.grad_input(dy2, w, check_finite=check_finite).to(x2.dtype).reshape(x_shape)
            if ctx.needs_input_grad[1]:
                dw = lowp.grad_weight(dy2, x2, w.format, w.scale_format, check_finite=check_finite).to(w_dtype)
            if ctx.needs_input_grad[2]:
                db = dy2.float().sum(0).to(w_dtype)
        return dx, dw, db, None, None


class Fp8Linear(nn.Linear):
    """nn.Linear with blockwise-FP8 forward and backward; same parameters and state_dict keys."""

    cache_weight = True  # keep Q(W) between forwards (off under FSDP2: distributed/parallel.py)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        quant: Quantization = BLOCK128,
        quantize_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self._configure(quant, quantize_dtype)

    def _configure(self, quant: Quantization, quantize_dtype: torch.dtype | None) -> None:
        """quant (quantization.py): format, scale format and finiteness checks, the layer's only knobs;
        quantize_dtype: the dtype the weight is rounded to before Q(W) (None: as stored; see the module
        docstring). Its quantize_from is the caller's to resolve into quantize_dtype (model/fp8_policy.py)."""
        if not isinstance(quant, Quantization):
            raise TypeError(f"Fp8Linear: quant must be a Quantization (fp8rl_core.fp8.quantization), got {quant!r}")
        scale_format = resolve_scale_format(quant.format, quant.scale_format)
        self.format = quant.format
        self.power_of_two = scale_format == "pow2"  # block128 / tensorwise scales rounded up to 2^k
        self._scale_format = scale_format
        self.check_finite = quant.check_finite
        self.quantize_dtype = quantize_dtype  # round the weight to this dtype before Q(W) (None: as stored)

    @property
    def scale_format(self) -> str:
        """The resolved scale format; for fp32/pow2 formats it follows the power_of_two attribute."""
        if self._scale_format in ("fp32", "pow2"):
            return "pow2" if self.power_of_two else "fp32"
        return self._scale_format

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> Fp8Linear:
        """Wrap an existing nn.Linear, sharing (not copying) its weight and bias Parameters.
        Options: quant (a Quantization, default block128) and quantize_dtype, as the constructor's."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new._configure(kw.pop("quant", BLOCK128), kw.pop("quantize_dtype", None))
        if kw:
            raise TypeError(f"Fp8Linear.from_linear: unexpected options {sorted(kw)}; valid: quant, quantize_dtype "
                            "(format, scale_format and check_finite are fields of quant=Quantization(...))")
        new.train(linear.training)
        return new

    def quantized_weight(self) -> Fp8Weight | lowp.QuantWeight:
        """Q(weight) (no bias): block128's Fp8Weight in [128, 128] blocks, or the format's lowp.QuantWeight
        with its fprop and dgrad copies; recomputed only when the weight may have changed (see the module
        docstring); non-finite weights raise."""
        w = self.weight
        key = (_optimizer_steps, w._version, w.data_ptr(), w.dtype, w.device, tuple(w.shape), self.power_of_two,
               self.quantize_dtype, self.format, self.scale_format)
        use_cache = self.cache_weight and weight_cache_enabled()
        cached = self.__dict__.get("_fp8_weight")
        if cached is not None and cached[0] == key and use_cache:
            return cached[1]
        with torch.no_grad(), torch.autocast(w.device.type, enabled=False):
            source = w if self.quantize_dtype is None else w.to(self.quantize_dtype)
            if self.format == "block128":
                q = quantize_weight(source, None, quant=Quantization(scale_format=self.scale_format))
            else:
                q = lowp.quantize_weight(source, None, format=self.format, scale_format=self.scale_format,
                                         dgrad=True)
        self.__dict__["_fp8_weight"] = (key, q) if use_cache else None
        return q

    def invalidate(self) -> None:
        """Drop the cached Q(weight) (only needed after a write that bumps no version counter)."""
        self.__dict__.pop("_fp8_weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        w = self.quantized_weight()
        if isinstance(w, lowp.QuantWeight):
            return _LowpLinearFn.apply(x, self.weight, self.bias, w, self.check_finite)
        return _Fp8LinearFn.apply(x, self.weight, self.bias, w, self.power_of_two, self.check_finite)

    def extra_repr(self) -> str:
        source = "as stored" if self.quantize_dtype is None else str(self.quantize_dtype).replace("torch.", "")
        fmt = "e4m3 blockwise" if self.format == "block128" else f"{self.format}, scale_format={self.scale_format}"
        return super().extra_repr() + f", fp8={fmt}, power_of_two={self.power_of_two}, quantize_from={source}"
