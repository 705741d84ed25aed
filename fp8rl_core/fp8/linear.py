"""`Fp8Linear`: a drop-in `nn.Linear` whose forward and backward GEMMs run in blockwise FP8.

Recipe (Transformer Engine's Float8BlockScaling, DeepSeek-V3 section 3.3), X [M, K], W [N, K], dY [M, N]:
    forward  Y  = Q(X)[1,128] . Q(W)[128,128]^T                     + b      (K contracted)
    dgrad    dX = Q(dY)[1,128] . Q(W)^T          (W's [128,128] grid transposed; N contracted)
    wgrad    dW = Q(dY^T)[1,128] . Q(X^T)[1,128]^T   i.e. dY and X re-quantized in [128, 1] blocks
                                                 (along tokens) from their high-precision copies
    db       = sum_tokens dY                                        (FP32)
Every GEMM accumulates in FP32 (see gemm.py). dX follows X's dtype, dW and db the parameters' dtype.

Autocast: the layer computes its own precision, so autocast is disabled inside the GEMMs. Under an
enabled autocast (CPU or CUDA) the input is first cast to the autocast dtype (bf16), so the output
dtype is what `nn.Linear` would return under the same autocast.
"""
from __future__ import annotations

import torch
from torch import nn

from fp8rl_core.fp8.functional import (
    ACT_BLOCK,
    COL_BLOCK,
    Fp8Weight,
    linear_from_operands,
    quantize_operand,
    quantize_weight,
)
from fp8rl_core.fp8.gemm import scaled_mm


def _grad_input(dy2: torch.Tensor, w: Fp8Weight, power_of_two: bool, check_finite: bool) -> torch.Tensor:
    """dX [M, K] = Q(dY)[1,128] . Q(W) in FP32: B = W^T [K, N], W's [128,128] grid transposed."""
    dy_op = quantize_operand(dy2, ACT_BLOCK, power_of_two=power_of_two, check_finite=check_finite, name="grad_output")
    return scaled_mm(dy_op, w.operand().t(), out_dtype=torch.float32)


def _grad_weight(dy2: torch.Tensor, x2: torch.Tensor, power_of_two: bool, check_finite: bool) -> torch.Tensor:
    """dW [N, K] = dY^T X over tokens M; dY [M, N] and X [M, K] re-quantized in [128, 1] blocks (along M)."""
    dy_op = quantize_operand(dy2, COL_BLOCK, power_of_two=power_of_two, check_finite=check_finite, name="grad_output")
    x_op = quantize_operand(x2, COL_BLOCK, power_of_two=power_of_two, check_finite=check_finite, name="x")
    return scaled_mm(dy_op.t(), x_op.t(), out_dtype=torch.float32)  # [N, M] (1,128) x [K, M] (1,128)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, power_of_two: bool, check_finite: bool):  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            w = quantize_weight(weight, bias, power_of_two=power_of_two)
            x_op = quantize_operand(x2, ACT_BLOCK, power_of_two=power_of_two, check_finite=check_finite, name="x")
            y = linear_from_operands(x_op, w, x.dtype)
        w.bias = None  # the saved weight is for dgrad only
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
                dx = _grad_input(dy2, ctx.w, power_of_two, check_finite).to(x2.dtype).reshape(x_shape)
            if ctx.needs_input_grad[1]:
                dw = _grad_weight(dy2, x2, power_of_two, check_finite).to(w_dtype)
            if ctx.needs_input_grad[2]:
                db = dy2.float().sum(0).to(w_dtype)
        return dx, dw, db, None, None


class Fp8Linear(nn.Linear):
    """nn.Linear with blockwise-FP8 forward and backward; same parameters and state_dict keys."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        power_of_two: bool = False,
        check_finite: bool = True,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.power_of_two = power_of_two
        self.check_finite = check_finite

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> "Fp8Linear":
        """Wrap an existing nn.Linear, sharing (not copying) its weight and bias Parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.power_of_two = kw.pop("power_of_two", False)
        new.check_finite = kw.pop("check_finite", True)
        if kw:
            raise TypeError(f"Fp8Linear.from_linear: unexpected options {sorted(kw)}; valid: power_of_two, check_finite")
        new.train(linear.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        return _Fp8LinearFn.apply(x, self.weight, self.bias, self.power_of_two, self.check_finite)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8=e4m3 blockwise, power_of_two={self.power_of_two}"
