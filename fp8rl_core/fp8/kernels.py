"""Pure-torch block kernels behind quant.py, written so that torch.compile can fuse each into one pass.

Tensors arrive blocked: xb [Mb, br, Nb, bc] (a free view of x[M, N] when M, N are block multiples).
Set FP8RL_COMPILE=1 (or call `set_compile(True)`) to run them through torch.compile (dynamic shapes;
the first call of each kernel compiles for ~30-60 s here, later processes reuse Inductor's disk cache).
Compiled and eager kernels give bit-identical results (tested).

Eager kernels use the fewest ops (native float8 casts). Compiled kernels (fused=True) round to E4M3
arithmetically (`round_to_e4m3`) and decode by bit manipulation (`e4m3_to_float`), because the
native float8 -> float32 conversion is scalar (slow) on CPUs even when compiled.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
# A nonzero block's scale never goes below FP32's smallest normal: a block of amax < 448 * 2**-126
# (~5e-36) would otherwise get a subnormal or zero scale (x / 0 = inf). Irrelevant for real tensors.
MIN_SCALE = 2.0**-126
_E4M3_MIN_NORMAL_EXP = -6  # E4M3 normals start at 2**-6; below, subnormals on a grid of 2**-9


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


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round FP32 values in [-448, 448] to the nearest E4M3 value (ties to even), staying in FP32.

    ulp = 2**(e - 3) for |v| in [2**e, 2**(e+1)) (3 mantissa bits), and 2**-9 below 2**-6 (subnormals).
    v / ulp and r * ulp are exact (powers of two), and torch.round rounds half to even.
    """
    exp_field = (v.view(torch.int32) >> 23) & 0xFF  # biased FP32 exponent of v
    ulp_field = torch.clamp_min(exp_field, 127 + _E4M3_MIN_NORMAL_EXP) - 3
    ulp = (ulp_field << 23).view(torch.float32)
    return torch.round(v / ulp) * ulp


def quantize_blocks(
    xb: torch.Tensor, power_of_two: bool, want_dequant: bool, fused: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """xb [Mb, br, Nb, bc] (fp32/bf16/fp16) -> (q E4M3 like xb, scale FP32 [Mb, Nb], deq FP32 or None).

    q = clamp(x / scale, -448, 448) rounded to E4M3 (x upcast to FP32, true division); deq = q * scale.
    NaN/inf in a block propagate into its scale, so the caller checks finiteness on the small scale.
    fused=False uses the fewest eager ops (native float8 casts); fused=True the arithmetic rounding
    that torch.compile fuses into one vectorized pass. Both give the same bits (tested).
    """
    amax = xb.abs().amax(dim=(1, 3)).float()
    scale = block_scales(amax, power_of_two)
    scale_b = scale[:, None, :, None]
    v = torch.clamp(xb / scale_b, -E4M3_MAX, E4M3_MAX)  # type promotion: computed in FP32
    if fused:
        r = round_to_e4m3(v)
        return r.to(FP8_DTYPE), scale, (r * scale_b if want_dequant else None)
    q = v.to(FP8_DTYPE)
    return q, scale, (q.float().mul_(scale_b) if want_dequant else None)


def dequantize_blocks(
    qb: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float32, fused: bool = False
) -> torch.Tensor:
    """qb [Mb, br, Nb, bc] E4M3, scale [Mb, Nb] -> q * scale, computed in FP32, cast to out_dtype."""
    x = (e4m3_to_float(qb) if fused else qb.float()) * scale[:, None, :, None]
    return x if out_dtype == torch.float32 else x.to(out_dtype)


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    """E4M3 -> FP32 by bit manipulation (vectorizes; the native float8 conversion is scalar on CPUs).

    bits seeeemmm: normal (e > 0) = 2**(e-7) * (1 + m/8); subnormal (e == 0) = m * 2**-9; 0x7f/0xff is NaN.
    """
    b = q.view(torch.uint8).to(torch.int32)
    sign = (b & 0x80) << 24
    e, m = (b >> 3) & 0xF, b & 0x7
    normal = (sign | ((e + 120) << 23) | (m << 20)).view(torch.float32)
    sub = (m.to(torch.float32) * 2.0**-9) * torch.where(sign != 0, -1.0, 1.0)
    out = torch.where(e == 0, sub, normal)
    return torch.where((b & 0x7F) == 0x7F, float("nan"), out)


_COMPILED: dict[str, Callable] = {}
_compile_enabled = os.environ.get("FP8RL_COMPILE", "0") not in ("", "0", "false", "False")


def set_compile(enabled: bool) -> None:
    """Run the quantization kernels through torch.compile (True) or eagerly (False)."""
    global _compile_enabled
    _compile_enabled = bool(enabled)


def compile_enabled() -> bool:
    return _compile_enabled


def kernel(fn: Callable) -> Callable:
    """fn eagerly, or its torch.compile'd twin (built once, dynamic shapes, fused=True) when compiling."""
    if not _compile_enabled:
        return fn
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = functools.partial(torch.compile(fn, dynamic=True), fused=True)
    return _COMPILED[fn.__name__]
