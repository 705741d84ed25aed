"""Issue 22's fp8/ defects in cuda_exec.py, on the CPU with fakes at the kernel boundary:
an out-of-memory error never switches a GEMM's output dtype, and the scaled_mm startup probe is held to the
project's bound (gemm_bound.BOUND) and fails loudly."""
from __future__ import annotations

import warnings

import pytest
import torch

from fp8rl_core.fp8 import cuda_exec, gemm, gemm_bound
from fp8rl_core.fp8.emulate import fold_mm
from fp8rl_core.fp8.operand import Operand
from fp8rl_core.fp8.quant import quantize_2d


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    monkeypatch.setattr(cuda_exec, "_OUT_DTYPES", {})
    monkeypatch.setattr(cuda_exec, "_FALLBACKS", {})
    monkeypatch.delenv(cuda_exec.NO_FALLBACK_ENV, raising=False)
    cuda_exec._probe_scaled_mm.cache_clear()
    yield
    cuda_exec._probe_scaled_mm.cache_clear()


def oom_kernel(failures: int, error: Exception | None = None):
    """A kernel call that runs out of memory `failures` times, then works (any dtype)."""
    calls = []

    def call(dtype):
        calls.append(dtype)
        if len(calls) <= failures:
            raise error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return torch.zeros(2, 2, dtype=dtype)
    return call, calls


@pytest.fixture
def empty_cache(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    return calls


def test_an_oom_is_retried_once_on_the_same_path(empty_cache):
    call, calls = oom_kernel(failures=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        out = cuda_exec.call_with_output_fallback(0, call)
    assert out.dtype == torch.float32 and calls == [torch.float32, torch.float32] and empty_cache == [1]
    assert cuda_exec.fallbacks() == {} and gemm.executor_flags() == {} and cuda_exec._OUT_DTYPES == {}


@pytest.mark.parametrize("error", [None, RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                                      "cublasLtMatmul")])
def test_a_second_oom_is_raised_and_numerics_never_switch(empty_cache, error):
    call, calls = oom_kernel(failures=2, error=error)
    with pytest.raises(torch.OutOfMemoryError, match="again after torch.cuda.empty_cache.*never switches"):
        cuda_exec.call_with_output_fallback(0, call)
    assert calls == [torch.float32, torch.float32] and empty_cache == [1]  # BF16 output was never tried
    assert cuda_exec.fallbacks() == {} and cuda_exec._OUT_DTYPES == {}
    call, calls = oom_kernel(failures=0)
    assert cuda_exec.call_with_output_fallback(0, call).dtype == torch.float32  # the next GEMM: still FP32


def test_a_device_on_bf16_output_stays_there_through_an_oom(empty_cache):
    cuda_exec._OUT_DTYPES[0] = torch.bfloat16
    call, calls = oom_kernel(failures=1)
    assert cuda_exec.call_with_output_fallback(0, call).dtype == torch.bfloat16
    assert calls == [torch.bfloat16, torch.bfloat16]


def hardware_like(extra: float = 2.0**-11):
    """A fake scaled_mm: the exact product plus a hardware-sized accumulation error of extra * C_abs."""
    def run_mm(a, b, out_dtype):
        c_abs = a.dequantized().abs() @ b.dequantized().abs().t()
        return fold_mm(a, b, out_dtype) + extra * c_abs
    return run_mm


def test_probe_accepts_hardware_accumulation_error_the_old_tolerance_refused():
    cpu = torch.device("cpu")
    ratio = cuda_exec.probe(cpu, hardware_like())
    assert 0.2 < ratio <= 0.26  # 2^-11 of C_abs is a quarter of the bound
    # the tolerance of the probe before issue 22 (1e-2 |want| + 1e-3) rejects this same output: on Hopper,
    # every FP8 GEMM would quietly have run the emulation
    g = torch.Generator().manual_seed(0)
    m, k, n = cuda_exec.PROBE_SHAPE
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    a = Operand(*quantize_2d(x, (1, 128), power_of_two=False, check_finite=True, name="p",
                             want_dequant=False)[:2], (1, 128))
    b = Operand(*quantize_2d(w, (128, 128), power_of_two=False, check_finite=True, name="p",
                             want_dequant=False)[:2], (128, 128))
    got, want = hardware_like()(a, b, torch.float32), fold_mm(a, b, torch.float32)
    assert not bool(((got - want).abs() <= 1e-2 * want.abs() + 1e-3).all())


def test_probe_uses_the_one_project_bound(monkeypatch):
    monkeypatch.setattr(gemm_bound, "BOUND", 2.0**-12)  # tighten the one bound: the same output now fails
    with pytest.raises(cuda_exec.ScaledMmProbeError):
        cuda_exec.probe(torch.device("cpu"), hardware_like())


def test_a_wrong_or_raising_probe_is_an_error_naming_the_fix():
    cpu = torch.device("cpu")
    with pytest.raises(cuda_exec.ScaledMmProbeError, match=r"x the bound .*2\^-9.*FP8RL_GEMM=emulated"):
        cuda_exec.probe(cpu, lambda a, b, dtype: 2 * fold_mm(a, b, dtype))

    def raising(a, b, dtype):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
    with pytest.raises(cuda_exec.ScaledMmProbeError, match="raised RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"):
        cuda_exec.probe(cpu, raising)


def test_on_sm90_a_failing_probe_fails_executor_selection(monkeypatch):
    monkeypatch.delenv(gemm.ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.setattr(cuda_exec, "has_blockwise_api", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def failing(device, run_mm=None):
        raise cuda_exec.ScaledMmProbeError(f"{device}: blockwise scaled_mm probe ... FP8RL_GEMM=emulated")
    monkeypatch.setattr(cuda_exec, "probe", failing)
    with pytest.raises(cuda_exec.ScaledMmProbeError, match="cuda:0"):
        gemm.select_executor("cuda")  # not "emulated": nothing falls back quietly
    monkeypatch.setattr(cuda_exec, "probe", lambda device, run_mm=None: 0.1)
    cuda_exec._probe_scaled_mm.cache_clear()
    assert gemm.select_executor("cuda") == "scaled_mm"
    monkeypatch.setenv(gemm.ENV_VAR, "emulated")  # the emulation, knowingly
    assert gemm.select_executor("cuda") == "emulated"


def test_without_hardware_support_the_emulation_runs_with_a_warning(monkeypatch):
    monkeypatch.delenv(gemm.ENV_VAR, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.warns(RuntimeWarning, match=r"cuda:0: no hardware FP8 blockwise GEMM \(capability \(8, 0\)"):
        assert gemm.select_executor("cuda") == "emulated"
