"""CUDA executors for the blockwise-scaled FP8 GEMM (imported lazily; never on a CPU-only path).

"scaled_mm": torch's DeepSeek-style blockwise scaling (pytorch PR #158037, cuBLAS >= 12.9, SM90 only),
recipes (1x128 A, 128x128 B) and (1x128 A, 1x128 B). cuBLASLt wants (torch checks the shapes):
  mat_a [M, K] row-major, mat_b [K, N] column-major (our B [N, K] row-major, transposed: "TN"),
  scale_a [M, K/128] with strides (1, M) (M-major),
  scale_b (128x128) [L4, N/128] with strides (1, L4), L4 = K/128 rounded up to a multiple of 4,
  scale_b (1x128) [N, K/128] with strides (1, N);
  K and N padded to multiples of 128 (zero data, unit scales), M to a multiple of 4.
Availability is probed once per device with a small GEMM held to the project's bound (gemm_bound.py:
|C - C_ref| <= 2^-9 C_abs against float64). Where the kernel should work (SM90, a torch with blockwise
scaled_mm) a probe that raises or misses the bound is an error (ScaledMmProbeError), never a quiet
switch to the emulation: FP8RL_GEMM=emulated runs the emulation knowingly. Elsewhere (another GPU, an
older torch) there is no hardware executor: one RuntimeWarning per device, and the run's tag
fp8rl.fp8_gemm says "emulated".
There is no "te" executor (Transformer Engine's GEMM on our own quantized tensors): TE's blockwise
tensor layouts are internal and version-specific; the Megatron-Core backend uses TE end to end.

Output dtype: the kernel is asked for FP32 output (the exact accumulation, cast once by the caller).
Some cuBLAS builds accept BF16 output only; when an FP32-output call raises and the same call with
BF16 output works, that device switches to BF16 output — never silently: a RuntimeWarning once per
device with the error, and `fallbacks()` / gemm.executor_flags() record it (a flag a run can log).
FP8RL_GEMM_NO_FALLBACK=1 raises the FP32 error instead. If the BF16 call fails too, the FP32 error
is raised (nothing is switched). An out-of-memory error is no reason to change numerics: the same call
(same output dtype) is retried once after torch.cuda.empty_cache(), then the error is raised.
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


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError, or cuBLAS failing to allocate its workspace (a plain RuntimeError)."""
    text = str(error)
    return (isinstance(error, torch.OutOfMemoryError) or "CUBLAS_STATUS_ALLOC_FAILED" in text
            or "out of memory" in text.lower())


def _retry_out_of_memory(dev: int, call: Callable[[torch.dtype], torch.Tensor], dtype: torch.dtype,
                         error: BaseException) -> torch.Tensor:
    """The same call once more after emptying the caching allocator; a second OOM is raised, naming both."""
    torch.cuda.empty_cache()
    try:
        return call(dtype)
    except RuntimeError as again:
        if not is_out_of_memory(again):
            raise
        raise torch.OutOfMemoryError(
            f"cuda:{dev}: blockwise scaled_mm ran out of memory, again after torch.cuda.empty_cache() "
            f"({str(again).strip().splitlines()[0][:300]}). An OOM never switches the GEMM's output dtype or "
            f"executor; free memory (smaller train.micro_batch_size / logprob_batch_size) instead.") from error


def call_with_output_fallback(dev: int, call: Callable[[torch.dtype], torch.Tensor]) -> torch.Tensor:
    """call(out_dtype) with the device's output dtype (FP32 until a fallback); see the module docstring."""
    kernel_dtype = _OUT_DTYPES.get(dev, torch.float32)
    try:
        return call(kernel_dtype)
    except RuntimeError as fp32_error:
        if is_out_of_memory(fp32_error):  # memory, not capability: same path, once more
            return _retry_out_of_memory(dev, call, kernel_dtype, fp32_error)
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


class ScaledMmProbeError(RuntimeError):
    """Blockwise scaled_mm should work on this device but its startup probe failed (see the docstring)."""


PROBE_SHAPE = (6, 384, 256)  # M, K, N: M not a multiple of 4, three K-blocks, two N-blocks


def has_blockwise_api() -> bool:
    return hasattr(F, "scaled_mm") and hasattr(getattr(F, "ScalingType", None), "BlockWise128x128")


def probe(device: torch.device, run_mm: Callable[[Operand, Operand, torch.dtype], torch.Tensor] | None = None
          ) -> float:
    """Run one PROBE_SHAPE GEMM on `device` through run_mm (default run_scaled_mm) and return its
    ratio to the bound (gemm_bound.bound_ratio); raises ScaledMmProbeError if it raises or exceeds it."""
    from fp8rl_core.fp8.gemm_bound import BOUND_TEXT, bound_ratio
    from fp8rl_core.fp8.quant import quantize_2d

    m, k, n = PROBE_SHAPE
    g = torch.Generator(device=device).manual_seed(0)
    x, w = torch.randn(m, k, device=device, generator=g), torch.randn(n, k, device=device, generator=g)
    qa, sa, _ = quantize_2d(x, (1, 128), power_of_two=False, check_finite=False, name="probe", want_dequant=False)
    qb, sb, _ = quantize_2d(w, (128, 128), power_of_two=False, check_finite=False, name="probe", want_dequant=False)
    a, b = Operand(qa, sa, (1, 128)), Operand(qb, sb, (128, 128))
    fix = f"FP8RL_GEMM=emulated runs the exact emulation on {device} knowingly"
    try:
        ratio, where = bound_ratio((run_mm or run_scaled_mm)(a, b, torch.float32), a, b)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ScaledMmProbeError(f"{device}: blockwise scaled_mm probe (M, K, N = {PROBE_SHAPE}) raised "
                                 f"{type(e).__name__}: {str(e).strip()[:300]}; {fix}") from e
    if not ratio <= 1.0:
        raise ScaledMmProbeError(f"{device}: blockwise scaled_mm probe (M, K, N = {PROBE_SHAPE}) is {ratio:.4g}x "
                                 f"the bound at C{list(where)} ({BOUND_TEXT}); {fix}")
    return ratio


@functools.cache
def _probe_scaled_mm(device_index: int) -> bool:
    """True if blockwise scaled_mm runs here within the bound; False (one warning) where the hardware or
    torch has no such kernel; raises ScaledMmProbeError where it should work and does not."""
    capability = torch.cuda.get_device_capability(device_index)
    if capability != (9, 0) or not has_blockwise_api():
        why = (f"capability {capability}, SM90 needed" if capability != (9, 0)
               else "this torch has no blockwise scaled_mm")
        warnings.warn(f"cuda:{device_index}: no hardware FP8 blockwise GEMM ({why}); FP8 GEMMs run the exact "
                      "emulation (FP32 GEMMs; the run's tag fp8rl.fp8_gemm says 'emulated')", RuntimeWarning,
                      stacklevel=3)
        return False
    probe(torch.device("cuda", device_index))
    return True


def available_executors(device: torch.device) -> list[str]:
    """Hardware executors usable on this CUDA device, fastest first (may be empty); raises
    ScaledMmProbeError where scaled_mm should work and fails its probe."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return ["scaled_mm"] if _probe_scaled_mm(index) else []


def run(name: str, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    if a.q.device.type != "cuda":
        raise ValueError(f"executor {name!r} needs CUDA tensors, got {a.q.device}; use 'emulated'")
    if name == "scaled_mm":
        return run_scaled_mm(a, b, out_dtype)
    raise ValueError(f"executor {name!r} is not a CUDA executor; valid: scaled_mm")
