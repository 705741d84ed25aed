"""The linear layer for every registry format (formats.py) other than block128's own path: quantized
operands, the emulated GEMM, and the forward / dgrad / wgrad that Fp8Linear and fp8_linear call.

A quantized operand is a `QTensor`: `body` FP32 [R, C], the format's codes times their block scales
(exact in FP32 for every format: E4M3 x 2^e, E2M1 x E4M3, E4M3 codes), and `scale`, a per-tensor FP32
factor (NVFP4's S, tensorwise's scale; None for MXFP8 and block128) that multiplies after the GEMM, as
cuBLAS's alpha does. Its value is fl(body * scale), the format's dequantization.

The emulated GEMM (any device; no hardware executor for these formats here):
    C = fl( fl(A_body @ B_body) * fl(scale_a * scale_b) )
products of two bodies are exact in FP32 (each body element has at most 4 significant bits beyond its
block scale, 8 for E4M3 codes), accumulated in FP32 by one IEEE FP32 GEMM (no TF32 / implicit BF16), then
rescaled once. Against float64 on the dequantized operands: |C - C64| <= (K + 6) * 2^-24 * (|A| @ |B|)
(tests). Block128's "emulated" executor is this GEMM with body = the dequantized copy and no scale.

Recipe, X [M, K], W [N, K], dY [M, N] (each format's quantize_operand / quantize_weight choose the blocks):
    fprop  Y  = Q_row(X) . Qw_fprop(W)^T        reduction over K
    dgrad  dX = Q_row(dY) . Qw_dgrad(W)         reduction over N (a columnwise weight copy where the
                                                 format's weight blocks are 1-D, e.g. MXFP8)
    wgrad  dW = Q_col(dY)^T . Q_col(X)          reduction over tokens M, re-quantized from the
                                                 high-precision X and dY
Fused generation weights (q|k|v, gate|up) are quantized per projection and concatenated (`concat`): a
per-tensor scale then becomes a per-row vector, applied to the output columns (fprop only).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from fp8rl_core.fp8.emulate import ieee_fp32_matmul
from fp8rl_core.fp8.formats import get_format, resolve_scale_format

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class QTensor:
    """A quantized GEMM operand: value = fl(body * scale). body FP32 [R, C]; scale None, FP32 0-d (per tensor)
    or FP32 [R] (per row: fused projections, fprop weights only). stored: the format's stored form
    (codes, block scales, ...), kept for inspection and checkpoints."""

    body: torch.Tensor
    scale: torch.Tensor | None = None
    stored: tuple = field(default=(), repr=False)

    def t(self) -> QTensor:
        if self.scale is not None and self.scale.dim() != 0:
            raise ValueError("a per-row scaled operand (fused projections) cannot be transposed")
        return QTensor(self.body.t(), self.scale, self.stored)

    def dequantized(self) -> torch.Tensor:
        """fl(body * scale) in FP32 [R, C]: the format's dequantization."""
        if self.scale is None:
            return self.body
        return self.body * (self.scale if self.scale.dim() == 0 else self.scale[:, None])


@dataclass
class QuantWeight:
    """A linear layer's weight [N, K] in a registry format: fprop copy (reduction along K), dgrad copy
    (reduction along N; None for inference, the same object where one quantization serves both), bias."""

    format: str
    scale_format: str
    fprop: QTensor
    dgrad: QTensor | None
    bias: torch.Tensor | None
    out_features: int
    in_features: int


def kernels(name: str) -> ModuleType:
    return get_format(name).kernels()


def check_input(x2: torch.Tensor, name: str) -> torch.Tensor:
    if x2.dtype not in INPUT_DTYPES:
        raise ValueError(f"{name}: dtype {x2.dtype} not supported; allowed: float32, bfloat16, float16")
    return x2.detach()


def raise_non_finite(name: str, shape: tuple[int, ...]) -> None:
    """The block128 quantizer's error (quant.py), for the same condition."""
    raise ValueError(f"{name}: non-finite values (NaN or inf) in a tensor to quantize, shape {shape}")


def mm(a: QTensor, b: QTensor) -> torch.Tensor:
    """C [M, N] = fl(fl(A_body [M, K] @ B_body [K, N]) * fl(scale_a * scale_b)) in FP32 (see module docstring).
    A per-row scale of B (fused projections) is a per-output-column factor here: B is a transposed weight."""
    with ieee_fp32_matmul(a.body.device.type):
        c = torch.mm(a.body, b.body)
    sa, sb = a.scale, b.scale
    factor = sa if sb is None else sb if sa is None else sa * sb
    return c if factor is None else c.mul_(factor)


def _wt(w: QTensor) -> QTensor:
    """The fprop weight as B [K, N] of mm: a per-row scale rides along as a per-column factor."""
    return QTensor(w.body.t(), w.scale, w.stored)


def quantize_weight(w: torch.Tensor, bias: torch.Tensor | None = None, *, format: str,
                    scale_format: str | None = None, check_finite: bool = True, dgrad: bool = False,
                    name: str = "weight") -> QuantWeight:
    """Quantize a [N, K] weight in `format` (once per refit / optimizer step). dgrad: also the copy dgrad
    contracts (the trainer). Non-finite weights raise when check_finite."""
    if w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [out_features, in_features] tensor, got shape {tuple(w.shape)}")
    scale_format = resolve_scale_format(format, scale_format)
    fprop, dg = kernels(format).quantize_weight(check_input(w, name), scale_format=scale_format,
                                                check_finite=check_finite, name=name, dgrad=dgrad)
    b = None if bias is None else bias.detach()
    return QuantWeight(format, scale_format, fprop, dg, b, w.shape[0], w.shape[1])


def concat(parts: list[QuantWeight], bias: torch.Tensor | None) -> QuantWeight:
    """Fused projections: the per-projection quantizations stacked along N (inference only: no dgrad copy).
    Per-tensor scales become a per-row vector; every block stays inside its projection."""
    first = parts[0]
    if len(parts) == 1:
        return QuantWeight(first.format, first.scale_format, first.fprop, None, bias, first.out_features,
                           first.in_features)
    body = torch.cat([p.fprop.body for p in parts])
    scales = [p.fprop.scale for p in parts]
    scale = None if scales[0] is None else torch.cat([s.expand(p.out_features) if s.dim() == 0 else s
                                                      for s, p in zip(scales, parts)])
    fprop = QTensor(body, scale, tuple(p.fprop.stored for p in parts))
    return QuantWeight(first.format, first.scale_format, fprop, None, bias, body.shape[0], first.in_features)


def forward(x2: torch.Tensor, w: QuantWeight, *, check_finite: bool, name: str = "x") -> torch.Tensor:
    """Y [M, N] = Q_row(X) . W^T in FP32 (no bias)."""
    x_op = kernels(w.format).quantize_operand(check_input(x2, name), 1, scale_format=w.scale_format,
                                              check_finite=check_finite, name=name)
    return mm(x_op, _wt(w.fprop))


def grad_input(dy2: torch.Tensor, w: QuantWeight, *, check_finite: bool) -> torch.Tensor:
    """dX [M, K] = Q_row(dY) . W, W quantized along N (its dgrad copy)."""
    if w.dgrad is None:
        raise ValueError("grad_input: the weight was quantized without its dgrad copy (dgrad=False)")
    dy_op = kernels(w.format).quantize_operand(check_input(dy2, "grad_output"), 1, scale_format=w.scale_format,
                                               check_finite=check_finite, name="grad_output")
    return mm(dy_op, w.dgrad)


def grad_weight(dy2: torch.Tensor, x2: torch.Tensor, format: str, scale_format: str, *,
                check_finite: bool) -> torch.Tensor:
    """dW [N, K] = Q_col(dY)^T . Q_col(X): both re-quantized along tokens M from the high-precision copies."""
    k = kernels(format)
    dy_op = k.quantize_operand(check_input(dy2, "grad_output"), 0, scale_format=scale_format,
                               check_finite=check_finite, name="grad_output")
    x_op = k.quantize_operand(check_input(x2, "x"), 0, scale_format=scale_format, check_finite=check_finite,
                              name="x")
    return mm(dy_op.t(), x_op)


def linear(x: torch.Tensor, w: QuantWeight, *, check_finite: bool = False) -> torch.Tensor:
    """Inference linear: x [..., K] -> y [..., N] in x.dtype, bias added in FP32 (as fp8_linear)."""
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x: last dim {x.shape[-1]} != in_features {w.in_features}")
    with torch.no_grad():
        y = forward(x.reshape(-1, x.shape[-1]), w, check_finite=check_finite)
        if w.bias is not None:
            y += w.bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.out_features)
