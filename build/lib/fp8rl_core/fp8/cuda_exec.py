"""CUDA executors for the blockwise-scaled FP8 GEMM (imported lazily; never on a CPU-only path).

"scaled_mm": torch's DeepSeek-style blockwise scaling (pytorch PR #158037, cuBLAS >= 12.9, SM90 only),
recipes (1x128 A, 128x128 B) and (1x128 A, 1x128 B). cuBLASLt wants (torch checks the shapes):
  mat_a [M, K] row-major, mat_b [K, N] column-major (our B [N, K] row-major, transposed: "TN"),
  scale_a [M, K/128] with strides (1, M) (M-major),
  scale_b (128x128) [L4, N/128] with strides (1, L4), L4 = K/128 rounded up to a multiple of 4,
  scale_b (1x128) [N, K/128] with strides (1, N);
  K and N padded to multiples of 128 (zero data, unit scales), M to a multiple of 4.
Availability is probed once per device with a small GEMM checked against the emulation.
There is no "te" executor (Transformer Engine's GEMM on our own quantized tensors): TE's blockwise
tensor layouts are internal and version-specific; the Megatron-Core backend uses TE end to end.

Output dtype: the kernel is asked for FP32 output (the exact accumulation, cast once by the caller).
Some cuBLAS builds accept BF16 output only; when an FP32-output call raises and the same call with
BF16 output works, that device switches to BF16 output — never silently: a RuntimeWarning once per
device with the error, and `fallbacks()` / gemm.executor_flags() record it (a flag a run can log).
FP8RL_GEMM_NO_FALLBACK=1 raises the FP32 error instead. If the BF16 call fails too, the FP32 error
is raised (nothing is switched).
"""
from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fp8rl_core.fp8.operand import Operand

_OUT_DTYPES: dict[int, torch.dtype] = {}  # device index -> output dtype the kernel accepted
_FALLBACKS: dict[int, str] = {}  # device index -> the FP32-output error that switched it to BF16 output
NO_FALLBACK_ENV = "FP8RL_GEMM_NO_FALLBACK"


def fallbacks() -> dict[int, str]:
    """Devices whose scaled GEMM fell back to BF16 output, with the FP32-output error (a copy)."""
    return dict(_FALLBACKS)


def call_with_output_fallback(dev: int, call: Callable[[torch.dtype], torch.Tensor]) -> torch.Tensor:
    """call(out_dtype) with the device's output dtype (FP32 until a fallback); see the module docstring."""
    kernel_dtype = _OUT_DTYPES.get(dev, torch.float32)
    try:
        return call(kernel_dtype)
    except RuntimeError as fp32_error:
        if kernel_dtype != torch.float32 or os.environ.get(NO_FALLBACK_ENV, "0") not in ("", "0"):
            raise
        try:
            out = call(torch.bfloat16)
        except RuntimeError:
            raise fp32_error from None
        _OUT_DTYPES[dev] = torch.bfloat16
        _FALLBACKS[dev] = f"{type(fp32_error).__name__}: {str(fp32_error).strip().splitlines()[0][:300]}"
        warnings.warn(f"cuda:{dev}: blockwise scaled_mm with FP32 output failed ({_FALLBACKS[dev]}); this device "
                      f"now runs FP8 GEMMs with BF16 output (one extra rounding per GEMM). "
                      f"{NO_FALLBACK_ENV}=1 raises instead.", RuntimeWarning, stacklevel=3)
        return out


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad2d(t: torch.Tensor, rows: int, cols: int, value: float = 0.0) -> torch.Tensor:
    """t [r, c] -> contiguous [rows, cols], padded with `value` (float8 data is padded as bytes: 0 = +0.0)."""
    if tuple(t.shape) == (rows, cols):
        return t.contiguous()
    src = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    out = torch.full((rows, cols), value, dtype=src.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]] = src
    return out.view(t.dtype)


def _scales(a: Operand, b: Operand, mp: int, np_: int, kb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale tensors in cuBLASLt's layouts (see the module docstring)."""
    sa = _pad2d(a.scale, mp, kb, 1.0).t().contiguous().t()  # [Mp, Kb], strides (1, Mp)
    if b.block[0] == 128:
        l4 = _round_up(kb, 4)
        sb = _pad2d(b.scale, np_ // 128, l4, 1.0).t()  # [L4, Np/128], strides (1, L4)
    else:
        sb = _pad2d(b.scale, np_, kb, 1.0).t().contiguous().t()  # [Np, Kb], strides (1, Np)
    return sa, sb


def run_scaled_mm(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """C [M, N] = A [M, K] B [N, K]^T through torch's blockwise scaled_mm (SM90)."""
    if a.block != (1, 128) or b.block not in ((1, 128), (128, 128)):
        raise ValueError(f"scaled_mm executor: supports A (1,128) x B (1,128)/(128,128) blocks, "
                         f"got {a.block} x {b.block}")
    (m, k), n = a.q.shape, b.q.shape[0]
    mp, kp, np_ = _round_up(m, 4), _round_up(k, 128), _round_up(n, 128)
    qa, qb = _pad2d(a.q, mp, kp), _pad2d(b.q, np_, kp)
    sa, sb = _scales(a, b, mp, np_, kp // 128)
    recipe_b = F.ScalingType.BlockWise128x128 if b.block[0] == 128 else F.ScalingType.BlockWise1x128
    dev = a.q.device.index or 0
    c = call_with_output_fallback(dev, lambda dtype: F.scaled_mm(
        qa, qb.t(), sa, F.ScalingType.BlockWise1x128, sb, recipe_b, output_dtype=dtype))
    return c[:m, :n].to(out_dtype)


@functools.cache
def _probe_scaled_mm(device_index: int) -> bool:
    """True if blockwise scaled_mm runs here and agrees with the emulation on a small GEMM."""
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "ScalingType", None), "BlockWise128x128"):
        return False
    from fp8rl_core.fp8.emulate import fold_mm
    from fp8rl_core.fp8.quant import quantize_2d

    dev = torch.device("cuda", device_index)
    g = torch.Generator(device=dev).manual_seed(0)
    x, w = torch.randn(6, 384, device=dev, generator=g), torch.randn(256, 384, device=dev, generator=g)
    qa, sa, _ = quantize_2d(x, (1, 128), power_of_two=False, check_finite=True, name="probe", want_dequant=False)
    qb, sb, _ = quantize_2d(w, (128, 128), power_of_two=False, check_finite=True, name="probe", want_dequant=False)
    a, b = Operand(qa, sa, (1, 128)), Operand(qb, sb, (128, 128))
    try:
        got = run_scaled_mm(a, b, torch.float32)
    except (RuntimeError, ValueError, TypeError):
        return False
    want = fold_mm(a, b, torch.float32)
    return bool(((got - want).abs() <= 1e-2 * want.abs() + 1e-3).all())


def available_executors(device: torch.device) -> list[str]:
    """Hardware executors usable on this CUDA device, fastest first (may be empty)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return ["scaled_mm"] if _probe_scaled_mm(index) else []


def run(name: str, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    if a.q.device.type != "cuda":
        raise ValueError(f"executor {name!r} needs CUDA tensors, got {a.q.device}; use 'emulated'")
    if name == "scaled_mm":
        return run_scaled_mm(a, b, out_dtype)
    raise ValueError(f"executor {name!r} is not a CUDA executor; valid: scaled_mm")
