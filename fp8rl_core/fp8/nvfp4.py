"""NVFP4: E2M1 elements, one E4M3 scale per block of 16, one FP32 scale per tensor (current scaling).

For x viewed as [M, K] (leading dims flattened into M), blocks (br, bc) = (1, 16) by default (16
consecutive elements along the last dim; (16, 16) is the 2-D weight option; partial blocks at the edges).
Every FP32 rounding, in this order:
    S = fl(amax(|x|) / 2688)                    (2688 = 6 * 448), or 1 if x is all zero
    b = E4M3_RNE(min(fl(amax_block / fl(6 * S)), 448))                       stored as E4M3
        (b = 0 for an all-zero block, also where fl(6 * S) underflows to 0: no 0/0)
    v = fl(x / fl(b * S)) rounded to the nearest E2M1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6} (sign apart),
        ties to the even code, saturating at 6; v = 0 where fl(b * S) = 0
    x ~= fl(fl(v * b) * S)                      (dequantize; fl(v * b) is exact)
Not bitwise Transformer Engine, which multiplies by reciprocals where this divides. Codes: one uint8 per
element, the E2M1 bit pattern (sign << 3 | magnitude index 0..7), unpacked. A non-finite input: S holds
the NaN/inf (check_finite raises first, naming the tensor), as block128's quantizer.

Training (NVIDIA's NVFP4 recipe for the block shapes), X [M, K], W [N, K], dY [M, N]:
    fprop  X [1,16] along K,   W [16,16] 2-D blocks
    dgrad  dY [1,16] along N,  the same [16,16] weight quantization (its blocks are square: one serves both)
    wgrad  dY and X [16,1] along the tokens M, re-quantized from the high-precision copies
Each operand's S comes from the tensor at hand. NVIDIA's recipe also applies random Hadamard transforms
to the wgrad operands and stochastically rounds gradients; this emulation uses neither (deterministic
round-to-nearest-even everywhere), so every bit is reproducible and the tests pin it exactly.
GEMM (lowp.py): body = fl(v * b) (exact), products exact in FP32, FP32 accumulation, times fl(S_a * S_b).
"""
from __future__ import annotations

import torch

from fp8rl_core.fp8.kernels import E4M3_MAX, FP8_DTYPE
from fp8rl_core.fp8.lowp import QTensor, check_input, raise_non_finite
from fp8rl_core.fp8.quant import as_2d, check_block, from_blocks, scale_shape, to_blocks

__all__ = ["ACT_BLOCK", "WEIGHT_BLOCK", "COL_BLOCK", "E2M1_VALUES", "e2m1_codes", "e2m1_round", "quantize_nvfp4",
           "dequantize_nvfp4", "quantize_operand", "quantize_weight"]

ACT_BLOCK, WEIGHT_BLOCK, COL_BLOCK = (1, 16), (16, 16), (16, 1)
E2M1_MAX = 6.0
TENSOR_DIV = E2M1_MAX * E4M3_MAX  # 2688
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # index = the E2M1 magnitude bits


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """v (FP32) -> the nearest E2M1 value, ties to the even code, saturating at +-6 (sign kept, NaN stays NaN).

    The grid has spacing h = 0.5 below 2, 1 on [2, 4) and 2 from 4 on (h from |v|'s exponent bits), and in
    each range a code's parity is that of its multiple of h, so round-half-even of v / h (exact: h is a
    power of two) times h is the rounding."""
    biased = ((v.view(torch.int32) >> 23) & 0xFF).clamp_(127, 129)  # |v| < 2 -> 127, [2, 4) -> 128, >= 4 -> 129
    h = ((biased - 1) << 23).view(torch.float32)  # 0.5, 1, 2
    return torch.round(v / h).mul_(h).clamp_(-E2M1_MAX, E2M1_MAX)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """E2M1 values (already on the grid, FP32) -> codes (uint8): sign << 3 | magnitude index."""
    r = v.abs()
    idx = torch.where(r < 2, r * 2, torch.where(r < 4, r + 2, r * 0.5 + 4)).to(torch.uint8)
    return idx | (torch.signbit(v).to(torch.uint8) << 3)


def _fdiv(a: torch.Tensor, c: float) -> torch.Tensor:
    """fl(a / c) as a true FP32 division on every device (a Python scalar divisor may become a reciprocal)."""
    return a / torch.full_like(a, c)


def _quantize_2d(x2: torch.Tensor, block: tuple[int, int], check_finite: bool, name: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x2 [M, K] -> (v: the E2M1 values, signed, FP32 blocked [Mb, br, Kb, bc]; b E4M3 [Mb, Kb]; S FP32 0-d)."""
    block = check_block(block)
    xf = x2.float()
    amax_t = xf.abs().amax() if xf.numel() else xf.new_zeros(())
    if check_finite and not bool(torch.isfinite(amax_t)):
        raise_non_finite(name, tuple(x2.shape))
    s = torch.where(amax_t == 0, torch.ones_like(amax_t), _fdiv(amax_t, TENSOR_DIV))
    xb = to_blocks(xf, block)  # [Mb, br, Kb, bc], zero-padded
    amax_b = xb.abs().amax(dim=(1, 3))
    six_s = s * torch.full_like(s, E2M1_MAX)
    b = torch.where(amax_b == 0, 0.0, amax_b / six_s).clamp_(max=E4M3_MAX).to(FP8_DTYPE)  # no 0/0 when 6S == 0
    bs = b.float() * s  # fl(b * S)
    zero = bs == 0
    v = xb / (torch.where(zero, 1.0, bs) if bool(zero.any()) else bs)[:, None, :, None]
    if bool(zero.any()):
        v.mul_(~zero[:, None, :, None])  # v = 0 where b * S = 0
    return e2m1_round(v), b, s


def _body(vb: torch.Tensor, b: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """fl(v * b) [M, K] (exact) from the blocked values, each block scale broadcast over its block."""
    return from_blocks(vb * b.float()[:, None, :, None], m, k)


def quantize_nvfp4(x: torch.Tensor, block: tuple[int, int] = ACT_BLOCK, *, check_finite: bool = True,
                   name: str = "x") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] fp32/bf16/fp16 -> (codes uint8 of x's shape, block_scale float8_e4m3fn
    [ceil(M/br), ceil(K/bc)], tensor_scale FP32 0-d). See the module docstring."""
    x2 = as_2d(check_input(x, name), name)
    vb, b, s = _quantize_2d(x2, block, check_finite, name)
    return e2m1_codes(from_blocks(vb, *x2.shape)).reshape(x.shape), b, s


def decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8) -> their values in FP32."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    mag = lut[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def dequantize_nvfp4(codes: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor,
                     block: tuple[int, int] = ACT_BLOCK) -> torch.Tensor:
    """fl(fl(v * b) * S) in FP32, codes' shape; each block scale broadcast over its block."""
    br, bc = check_block(block)
    c2 = as_2d(codes, "codes")
    expected = scale_shape(tuple(c2.shape), (br, bc))
    if tuple(block_scale.shape) != expected:
        raise ValueError(f"block_scale: shape {tuple(block_scale.shape)} does not match codes "
                         f"{tuple(codes.shape)} with block {(br, bc)}; expected {expected}")
    m, k = c2.shape
    b = block_scale.float().repeat_interleave(br, 0)[:m].repeat_interleave(bc, 1)[:, :k]
    return (decode(c2) * b * tensor_scale.float()).reshape(codes.shape)


def quantize_operand(x2: torch.Tensor, along: int, *, scale_format: str, check_finite: bool, name: str) -> QTensor:
    """x2 [R, C] in [1,16] blocks along C (along=1) or [16,1] blocks along R (along=0), its own S."""
    vb, b, s = _quantize_2d(x2, ACT_BLOCK if along == 1 else COL_BLOCK, check_finite, name)
    return QTensor(_body(vb, b, *x2.shape), s, (b, s))


def quantize_weight(w2: torch.Tensor, *, scale_format: str, check_finite: bool, name: str, dgrad: bool
                    ) -> tuple[QTensor, QTensor | None]:
    """W [N, K] in [16,16] blocks: one quantization serves fprop and dgrad."""
    vb, b, s = _quantize_2d(w2, WEIGHT_BLOCK, check_finite, name)
    op = QTensor(_body(vb, b, *w2.shape), s, (e2m1_codes(from_blocks(vb, *w2.shape)), b, s))
    return op, (op if dgrad else None)
