"""MXFP8 (OCP Microscaling, Transformer Engine's MXFP8BlockScaling): E4M3 elements, one power-of-two
(E8M0) scale per 32 consecutive elements along the GEMM's reduction dim.

For x [M, K] and the default dim (K), per block of 32 elements (the last block of a row may be partial):
    q_amax = fl32(amax(|block|) / 448)
    e      = the smallest integer with 2^e >= q_amax, read from q_amax's FP32 bits: its unbiased exponent,
             plus 1 if its mantissa is nonzero (subnormal q_amax: -127 up to 2^-127, else -126), clamped
             to [-127, 127]; an all-zero block gets e = -127
    scale  = 2^e (FP32 holding the exact power of two; every value is an E8M0 code)
    q      = E4M3(clamp(x / 2^e, +-448)), ties to even;   x ~= q * scale (exact in FP32)
Rounding e up (not to nearest, as a cast to float8_e8m0fnu would) is what TE and cuBLAS do: no element
saturates. Unlike TE, a tiny block (biased exponent 0) is not flushed to zero. Non-finite blocks: the
scale holds the NaN/inf (check_finite raises first, naming the tensor), as block128's quantizer.

Scales are returned as FP32 tensors (exact powers of two, 2^-127 included as an FP32 subnormal), not as
torch.float8_e8m0fnu: the emulated GEMM multiplies in FP32 anyway; the memory plan counts 1 byte each.

Training (TE's recipe, 1x32 along the reduction dim of every GEMM), X [M, K], W [N, K], dY [M, N]:
    fprop  X rowwise [1,32] along K,  W rowwise [1,32] along K
    dgrad  dY rowwise [1,32] along N, W columnwise [32,1] along N (a second copy of the weight)
    wgrad  dY and X columnwise [32,1] along the tokens M (re-quantized from the high-precision copies)
GEMM (lowp.py): the dequantized operands are exact in FP32 and so are their products; FP32 accumulation.
"""
from __future__ import annotations

import torch

from fp8rl_core.fp8.kernels import E4M3_MAX, FP8_DTYPE
from fp8rl_core.fp8.lowp import QTensor, check_input, raise_non_finite

__all__ = ["BLOCK", "quantize_mxfp8", "dequantize_mxfp8", "quantize_operand", "quantize_weight"]

BLOCK = 32


def scale_exponent(q_amax: torch.Tensor) -> torch.Tensor:
    """e (int32) = the smallest integer with 2^e >= q_amax (FP32, >= 0), from the bits; clamped to [-127, 127]."""
    bits = q_amax.view(torch.int32)
    biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    e = biased - 127 + (mantissa != 0).to(torch.int32)
    subnormal = torch.where(mantissa > 0x400000, -126, -127).to(torch.int32)  # q_amax in (0, 2^-126), or 0
    return torch.where(biased == 0, subnormal, e).clamp(-127, 127)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e exactly in FP32 for int32 e in [-127, 127] (2^-127 is the FP32 subnormal 0x00400000)."""
    bits = torch.where(e >= -126, (e + 127) << 23, torch.full_like(e, 0x00400000))
    return bits.to(torch.int32).view(torch.float32)


def _quantize_rows(x2: torch.Tensor, check_finite: bool, name: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x2 [R, L] -> (q E4M3 [R, L], scale FP32 [R, ceil(L/32)], dequantized FP32 [R, L]), blocks along L."""
    r, length = x2.shape
    nb = -(-length // BLOCK)
    xf = x2.float()
    pad = nb * BLOCK - length
    xb = (torch.nn.functional.pad(xf, (0, pad)) if pad else xf).reshape(r, nb, BLOCK)
    amax = xb.abs().amax(dim=2) if length else xf.new_zeros(r, nb)
    q_amax = amax / torch.full_like(amax, E4M3_MAX)  # an FP32 division on every device (no reciprocal)
    scale = pow2(scale_exponent(q_amax))
    scale = torch.where(torch.isfinite(amax), scale, amax)  # NaN/inf reach the scale: the finiteness check
    if check_finite and not bool(torch.isfinite(scale).all()):
        raise_non_finite(name, tuple(x2.shape))
    q = (xb / scale[:, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    deq = q.float().mul_(scale[:, :, None])
    return q.reshape(r, nb * BLOCK)[:, :length], scale, deq.reshape(r, nb * BLOCK)[:, :length]


def _quantize(x: torch.Tensor, dim: int, check_finite: bool, name: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [...] blocked along `dim` -> (q like x, scale like x with dim -> ceil(size/32), dequantized like x)."""
    if x.dim() == 0:
        raise ValueError(f"{name}: a scalar cannot be block-quantized; need at least 1 dimension")
    x = check_input(x, name)
    moved = x.movedim(dim, -1)
    q, scale, deq = _quantize_rows(moved.reshape(-1, moved.shape[-1]), check_finite, name)
    lead = moved.shape[:-1]
    back = lambda t: t.reshape(*lead, t.shape[-1]).movedim(-1, dim).contiguous()  # noqa: E731
    return back(q), back(scale), back(deq)


def quantize_mxfp8(x: torch.Tensor, dim: int = -1, *, check_finite: bool = True, name: str = "x"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (fp32/bf16/fp16) -> (q float8_e4m3fn of x's shape, scale FP32 of x's shape with `dim` cut to
    ceil(size/32): [M, ceil(K/32)] for a 2-D x and the default dim). See the module docstring."""
    q, scale, _ = _quantize(x, dim, check_finite, name)
    return q, scale


def dequantize_mxfp8(q: torch.Tensor, scale: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """q * scale in FP32 (exact), each scale broadcast over its 32 elements along `dim`."""
    size = q.shape[dim]
    s = scale.float().repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, size)
    return q.float() * s


def quantize_operand(x2: torch.Tensor, along: int, *, scale_format: str, check_finite: bool, name: str) -> QTensor:
    """x2 [R, C] in [1,32] blocks along C (along=1) or [32,1] blocks along R (along=0)."""
    q, scale, deq = _quantize(x2, -1 if along == 1 else 0, check_finite, name)
    return QTensor(deq, None, (q, scale))


def quantize_weight(w2: torch.Tensor, *, scale_format: str, check_finite: bool, name: str, dgrad: bool
                    ) -> tuple[QTensor, QTensor | None]:
    """W [N, K]: rowwise [1,32] along K for fprop; with dgrad, columnwise [32,1] along N as well."""
    fprop = quantize_operand(w2, 1, scale_format=scale_format, check_finite=check_finite, name=name)
    return fprop, (quantize_operand(w2, 0, scale_format=scale_format, check_finite=check_finite, name=name)
                   if dgrad else None)
