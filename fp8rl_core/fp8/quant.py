"""Blockwise E4M3 quantization with FP32 per-block scales (DeepSeek-V3 / vLLM conventions).

For a 2-D view x[M, N] cut into blocks of (br, bc) elements (trailing blocks may be partial):

    amax[i, j]  = max |x| over the real elements of block (i, j)          (FP32)
    scale[i, j] = amax[i, j] / 448                                         (FP32 division)
                  1.0 where amax == 0 (all-zero block: no NaN, ever)
    q           = clamp(x / scale, -448, 448) rounded to E4M3              (FP32 division, ties to even)
    x          ~= q.float() * scale                                         (`scale` is the dequant multiplier)

The stored scale is the dequantization multiplier (`weight_scale_inv` in HF checkpoints).
Blocks: (1, 128) for activations and output gradients, (128, 128) for weights, (128, 1) for the
column-wise re-quantization of the wgrad operands; any (br, bc) with br, bc >= 1 works.

check_finite on CUDA does not sync: reading a GPU flag on every call would stall the host once per
quantized tensor. The check is recorded on the device instead (the first non-finite call of each
device, by index) and `check_nonfinite()` reads it, once per step (the run loop calls it), raising the
same ValueError the CPU raises at once. Elsewhere (CPU) the check raises immediately, as always.
"""
from __future__ import annotations

import torch

from fp8rl_core.fp8 import fused_cpu
from fp8rl_core.fp8.kernels import (
    E4M3_MAX,
    FP8_DTYPE,
    MIN_SCALE,
    compile_enabled,
    dequantize_blocks,
    kernel,
    quantize_blocks,
)

__all__ = ["E4M3_MAX", "FP8_DTYPE", "MIN_SCALE", "check_nonfinite", "quantize_blockwise", "dequantize_blockwise"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Block = tuple[int, int]


def as_2d(x: torch.Tensor, name: str = "x") -> torch.Tensor:
    """View x[..., N] as [prod(leading), N]; a 1-D x becomes [1, N]. Raises for 0-D x."""
    if x.dim() == 0:
        raise ValueError(f"{name}: a scalar cannot be block-quantized; need at least 1 dimension")
    return x.reshape(-1, x.shape[-1])


def check_block(block: Block, name: str = "block") -> tuple[int, int]:
    """Validate a (rows, cols) block shape and return it as a tuple of ints."""
    try:
        br, bc = (int(b) for b in block)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a pair (rows, cols) like (1, 128) or (128, 128), got {block!r}") from None
    if br < 1 or bc < 1:
        raise ValueError(f"{name}: block sides must be >= 1, got {block!r}")
    return br, bc


def scale_shape(shape2d: tuple[int, int], block: Block) -> tuple[int, int]:
    """(ceil(M / br), ceil(N / bc)): the shape of the scale grid of a 2-D [M, N] tensor."""
    (m, n), (br, bc) = shape2d, block
    return (-(-m // br), -(-n // bc))


def to_blocks(x2: torch.Tensor, block: Block) -> torch.Tensor:
    """x2[M, N] -> [Mb, br, Nb, bc]; zero-padded (a copy) only when M or N is not a block multiple.

    Zeros never change an amax of |x|, so partial blocks take their amax over the real elements.
    """
    (m, n), (br, bc) = x2.shape, block
    mb, nb = scale_shape((m, n), block)
    pad_m, pad_n = mb * br - m, nb * bc - n
    if pad_m or pad_n:
        x2 = torch.nn.functional.pad(x2, (0, pad_n, 0, pad_m))
    elif not x2.is_contiguous():
        x2 = x2.contiguous()
    return x2.view(mb, br, nb, bc)


def from_blocks(xb: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """[Mb, br, Nb, bc] -> [M, N], dropping the padding (a view when there is none)."""
    full = xb.view(xb.shape[0] * xb.shape[1], xb.shape[2] * xb.shape[3])
    return full if full.shape == (m, n) else full[:m, :n]


def quantize_2d(
    x2: torch.Tensor, block: Block, *, power_of_two: bool, check_finite: bool, name: str, want_dequant: bool,
    want_q: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """quantize_blockwise on a 2-D [M, N] x2, optionally also returning deq = q * scale in FP32 [M, N].
    want_q False (with want_dequant): q may come back None (the fused kernel then skips its bytes)."""
    if x2.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{name}: dtype {x2.dtype} not supported; allowed: float32, bfloat16, float16")
    (m, n), block = x2.shape, check_block(block)
    x2 = x2.detach()  # quantization is not differentiated (Fp8Linear defines its own backward)
    # the fused CPU kernel gives the reference's bits; it declines (None) non-finite blocks, so the
    # finiteness check below only ever sees the reference's scales
    fused = None if compile_enabled() else fused_cpu.quantize(x2, block, power_of_two, want_dequant, want_q=want_q)
    if fused is not None:
        return fused
    qb, scale, deqb = kernel(quantize_blocks)(to_blocks(x2, block), power_of_two, want_dequant)
    if check_finite:
        message = f"{name}: non-finite values (NaN or inf) in a tensor to quantize, shape {tuple(x2.shape)}"
        if defers_finite_check(scale.device):
            _record_nonfinite(scale, message)
        elif not bool(torch.isfinite(scale).all()):
            raise ValueError(message)
    q = from_blocks(qb, m, n)
    deq = None if deqb is None else from_blocks(deqb, m, n)
    return q, scale, deq


# device -> (flag: int64 0-d tensor on it, -1 or the index of the first non-finite call; messages -> index)
_PENDING: dict[torch.device, tuple[torch.Tensor, dict[str, int]]] = {}


def defers_finite_check(device: torch.device) -> bool:
    """Whether check_finite is recorded on the device (CUDA: no sync) rather than raised at once."""
    return device.type == "cuda"


def _record_nonfinite(scale: torch.Tensor, message: str) -> None:
    """Mark `message` on scale's device if scale holds NaN/inf and nothing was marked yet: device ops
    only (no .item(), no bool()). Messages repeat every step (same layers, same shapes), so the table
    of messages stays as small as the model."""
    flag, messages = _PENDING.setdefault(scale.device, (torch.full((), -1, dtype=torch.int64,
                                                                    device=scale.device), {}))
    index = messages.setdefault(message, len(messages))
    first = torch.isfinite(scale).all().logical_not_().logical_and_(flag < 0)
    flag.masked_fill_(first, index)


def check_nonfinite() -> None:
    """Read the deferred finiteness checks (one sync per device that has any) and clear them; raise the
    ValueError of the first tensor that held NaN/inf since the last call. Cheap when nothing deferred."""
    pending = list(_PENDING.items())
    _PENDING.clear()
    for _, (flag, messages) in pending:
        index = int(flag.item())
        if index >= 0:
            raise ValueError(next(m for m, i in messages.items() if i == index))


def dequantize_2d(q2: torch.Tensor, scale: torch.Tensor, block: Block, out_dtype: torch.dtype = torch.float32
                  ) -> torch.Tensor:
    """q2 [M, N] E4M3, scale [Mb, Nb] -> q * scale in FP32, cast to out_dtype (fused kernel or reference)."""
    fused = None if compile_enabled() else fused_cpu.dequantize(q2, scale, block, out_dtype)
    if fused is not None:
        return fused
    return from_blocks(kernel(dequantize_blocks)(to_blocks(q2, block), scale.float(), out_dtype), *q2.shape)


def quantize_blockwise(
    x: torch.Tensor,
    block: Block = (1, 128),
    *,
    power_of_two: bool = False,
    check_finite: bool = True,
    name: str = "x",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x to E4M3 with one FP32 scale per block of its 2-D view.

    x: [..., N] in fp32/bf16/fp16; leading dims are flattened into M (the 2-D view [M, N]).
    Returns q (float8_e4m3fn, x's shape) and scale (float32, [ceil(M/br), ceil(N/bc)]).
    The arithmetic is exactly: x.float() / scale (a true FP32 division, not a multiply by the
    reciprocal), clamp to +-448, round to nearest E4M3 with ties to even. See the module docstring.
    power_of_two: scale = 2**ceil(log2(amax / 448)) instead (Transformer Engine's option).
    check_finite: raise ValueError naming `name` if x holds NaN/inf (checked on the per-block scales,
    which any NaN/inf reaches, so the check is nearly free); False skips it. On CUDA the error comes
    from `check_nonfinite()`, without a sync per call (module docstring).
    """
    q, scale, _ = quantize_2d(
        as_2d(x, name), block, power_of_two=power_of_two, check_finite=check_finite, name=name, want_dequant=False
    )
    return q.reshape(x.shape).contiguous(), scale


def dequantize_blockwise(
    q: torch.Tensor, scale: torch.Tensor, block: Block = (1, 128), out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """x ~= q.float() * scale, broadcast over blocks; q [..., N] E4M3, scale [ceil(M/br), ceil(N/bc)].

    The product is taken in FP32 (exact for power-of-two scales) and then cast to out_dtype.
    """
    block = check_block(block)
    q2 = as_2d(q, "q")
    expected = scale_shape(tuple(q2.shape), block)
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale: shape {tuple(scale.shape)} does not match q {tuple(q.shape)} "
                         f"with block {block}; expected {expected}")
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"q: expected float8_e4m3fn, got {q.dtype}")
    return dequantize_2d(q2, scale, block, out_dtype).reshape(q.shape)
