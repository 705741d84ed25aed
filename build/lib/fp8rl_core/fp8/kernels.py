"""Pure-torch block kernels behind quant.py, written so that torch.compile can fuse each into one pass.

Tensors arrive blocked: xb [Mb, br, Nb, bc] (a free view of x[M, N] when M, N are block multiples).
Set FP8RL_COMPILE=1 (or call `set_compile(True)`) to run them through torch.compile (dynamic shapes;
the first call of each kernel compiles for ~30-60 s here, later processes reuse Inductor's disk cache).
Compiled and eager kernels give bit-identical results (tested).

Measured here: compiled, the quantizer fuses into ~2 passes (about 2x a copy of the input), while
float8 -> float32 decoding stays slow (no vector instruction for it on these CPUs; an arithmetic
rounding/decoding by bit manipulation was tried and was slower than the native casts).
On the CPU these kernels are the reference: quant.py runs fused_cpu.c (same bits, one pass) instead,
unless compiling is on or FP8RL_FUSED=0.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
# A nonzero block's scale never goes below FP32's smallest normal: a block of amax < 448 * 2**-126
# (~5e-36) would otherwise get a subnormal or zero scale (x / 0 = inf). Irrelevant for real tensors.
MIN_SCALE = 2.0**-126


def block_scales(amax: torch.Tensor, power_of_two: bool) -> torch.Tensor:
    """FP32 dequant scale per block: amax / 448 (1.0 if amax == 0); optionally rounded up to 2**k."""
    scale = amax / E4M3_MAX
    scale = torch.where(amax == 0, torch.ones_like(scale), scale.clamp_min(MIN_SCALE))
    if power_of_two:
        # 2**ceil(log2(scale)) from the bits: keep the exponent, add one unless the mantissa is zero
        bits = scale.view(torch.int32)
        exp_bits = bits & 0x7F800000
        exp_bits = torch.where((bits & 0x007FFFFF) != 0, exp_bits + 0x00800000, exp_bits)
        scale = exp_bits.view(torch.float32)
    return torch.where(torch.isfinite(amax), scale, amax)  # NaN/inf reach the scale: the finiteness check


def quantize_blocks(
    xb: torch.Tensor, power_of_two: bool, want_dequant: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """xb [Mb, br, Nb, bc] (fp32/bf16/fp16) -> (q E4M3 like xb, scale FP32 [Mb, Nb], deq FP32 or None).

    q = clamp(x / scale, -448, 448) cast to E4M3 (x upcast to FP32, true division, round to nearest
    even); deq = q * scale. NaN/inf in a block propagate into its scale, so the caller checks
    finiteness on the small scale tensor.
    """
    amax = xb.abs().amax(dim=(1, 3)).float()
    scale = block_scales(amax, power_of_two)
    scale_b = scale[:, None, :, None]
    q = (xb / scale_b).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)  # type promotion: divides in FP32
    return q, scale, (q.float().mul_(scale_b) if want_dequant else None)


def dequantize_blocks(qb: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """qb [Mb, br, Nb, bc] E4M3, scale [Mb, Nb] -> q * scale, computed in FP32, cast to out_dtype."""
    x = qb.float().mul_(scale[:, None, :, None])  # in place: fresh memory is the slow part here
    return x if out_dtype == torch.float32 else x.to(out_dtype)


_COMPILED: dict[tuple, Callable] = {}
_compile_enabled = os.environ.get("FP8RL_COMPILE", "0") not in ("", "0", "false", "False")


def set_compile(enabled: bool) -> None:
    """Run the quantization kernels through torch.compile (True) or eagerly (False)."""
    global _compile_enabled
    _compile_enabled = bool(enabled)


def compile_enabled() -> bool:
    return _compile_enabled


def kernel(fn: Callable) -> Callable:
    """fn eagerly, or a torch.compile'd twin (dynamic shapes) when compiling is on."""
    return functools.partial(_compiled_call, fn) if _compile_enabled else fn


def _compiled_call(fn: Callable, *args):
    """One compiled graph per (kernel, flags, dtypes), each with its own recompile budget; tensors are
    detached first (quantization is not differentiated; requires_grad would force recompiles)."""
    key = (fn.__name__,) + tuple(a.dtype if isinstance(a, torch.Tensor) else a for a in args)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=True)
    return _COMPILED[key](*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
