"""GEMM executor selection and the FP32 -> BF16 output fallback of the CUDA executor (cuda_exec.py).

The fallback logic runs on the CPU with a stand-in for the kernel call (the boundary: F.scaled_mm,
which needs an SM90 GPU): it must warn once, record the switch, and never swallow an error that BF16
output does not cure.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from fp8rl_core.fp8 import EXECUTORS, cuda_exec, gemm


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    monkeypatch.setattr(cuda_exec, "_OUT_DTYPES", {})
    monkeypatch.setattr(cuda_exec, "_FALLBACKS", {})
    monkeypatch.delenv(cuda_exec.NO_FALLBACK_ENV, raising=False)


def kernel(fail_fp32: bool = True, fail_bf16: bool = False):
    calls = []

    def call(dtype):
        calls.append(dtype)
        if (dtype == torch.float32 and fail_fp32) or (dtype == torch.bfloat16 and fail_bf16):
            raise RuntimeError(f"CUBLAS_STATUS_NOT_SUPPORTED for {dtype}")
        return torch.zeros(2, 2, dtype=dtype)
    return call, calls


def test_te_is_not_an_executor():
    assert "te" not in EXECUTORS
    valid = "emulated, emulated_blockwise, cpu_bf16dot, scaled_mm"
    with pytest.raises(ValueError, match=f"unknown executor 'te'; valid: {valid}"):
        gemm.select_executor("cpu", "te")


def test_fp32_output_failure_falls_back_to_bf16_with_one_warning_and_a_flag():
    call, calls = kernel()
    assert gemm.executor_flags() == {}
    with pytest.warns(RuntimeWarning, match="cuda:0: blockwise scaled_mm with FP32 output failed.*BF16 output"):
        out = cuda_exec.call_with_output_fallback(0, call)
    assert out.dtype == torch.bfloat16 and calls == [torch.float32, torch.bfloat16]
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in cuda_exec.fallbacks()[0]
    assert gemm.executor_flags() == {"fp8_gemm_bf16_output_fallback": 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second GEMM goes straight to BF16, without a new warning
        cuda_exec.call_with_output_fallback(0, call)
    assert calls[2:] == [torch.bfloat16]


def test_errors_bf16_does_not_cure_are_raised_and_nothing_switches():
    call, _ = kernel(fail_bf16=True)
    with pytest.raises(RuntimeError, match="float32"):
        cuda_exec.call_with_output_fallback(0, call)
    assert cuda_exec.fallbacks() == {} and cuda_exec._OUT_DTYPES == {}


def test_no_fallback_env_raises_the_fp32_error(monkeypatch):
    monkeypatch.setenv(cuda_exec.NO_FALLBACK_ENV, "1")
    call, calls = kernel()
    with pytest.raises(RuntimeError, match="float32"):
        cuda_exec.call_with_output_fallback(0, call)
    assert calls == [torch.float32] and cuda_exec.fallbacks() == {}


def test_fp32_success_records_nothing():
    call, calls = kernel(fail_fp32=False)
    assert cuda_exec.call_with_output_fallback(1, call).dtype == torch.float32
    assert cuda_exec.fallbacks() == {} and calls == [torch.float32]
