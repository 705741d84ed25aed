"""Issue 22: the quantizer's NaN/inf check without a GPU->CPU sync per call (fp8/quant.py).

The CUDA path is taken on the CPU by faking the device test (quant.defers_finite_check) and the fused CPU
kernel's absence (as on CUDA); while it runs, Tensor.item and Tensor.__bool__ raise, so any sync shows.
"""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.fp8 import quant
from fp8rl_core.fp8.quant import check_nonfinite, quantize_2d, quantize_blockwise


def nan_at(shape, where):
    x = torch.randn(*shape)
    x[where] = float("nan")
    return x


def test_cpu_behaviour_is_unchanged():
    with pytest.raises(ValueError, match=r"^grad_output: non-finite values \(NaN or inf\) in a tensor to quantize, "
                                         r"shape \(4, 256\)$"):
        quantize_blockwise(nan_at((4, 256), (1, 3)), (1, 128), name="grad_output")
    q, s = quantize_blockwise(nan_at((4, 256), (1, 3)), (1, 128), check_finite=False)  # unchecked: propagates
    assert torch.isnan(s[1, 0]) and torch.isfinite(s[0]).all()
    check_nonfinite()  # nothing deferred on a CPU


@pytest.fixture
def deferred(monkeypatch):
    """The CUDA path on this CPU, with syncs forbidden while quantizing."""
    monkeypatch.setattr(quant, "defers_finite_check", lambda device: True)
    monkeypatch.setattr(quant.fused_cpu, "quantize", lambda *a, **k: None)  # no fused CPU kernel on CUDA
    monkeypatch.setattr(quant, "_PENDING", {})

    def forbidden(*args, **kwargs):
        raise AssertionError("a GPU->CPU sync (.item() / bool()) on the quantizer's CUDA path")

    def quantize(x, name):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch.Tensor, "item", forbidden)
            mp.setattr(torch.Tensor, "__bool__", forbidden)
            return quantize_2d(x, (1, 128), power_of_two=False, check_finite=True, name=name, want_dequant=False)
    return quantize


def test_the_cuda_path_does_not_sync_and_reports_once_per_step(deferred):
    deferred(torch.randn(4, 256), "x")
    check_nonfinite()  # all finite: nothing to raise
    deferred(torch.randn(4, 256), "x")
    deferred(nan_at((6, 384), (5, 300)), "grad_output")  # the first non-finite tensor of the step
    deferred(nan_at((2, 128), (0, 0)), "x")
    with pytest.raises(ValueError, match=r"^grad_output: non-finite values \(NaN or inf\) in a tensor to quantize, "
                                         r"shape \(6, 384\)$"):
        check_nonfinite()
    check_nonfinite()  # read and cleared: the next step starts clean
    assert quant._PENDING == {}


def test_messages_stay_as_few_as_the_distinct_tensors(deferred):
    for _ in range(50):  # a step's tensors repeat every step
        deferred(torch.randn(4, 256), "x")
        deferred(torch.randn(4, 256), "grad_output")
    (_, messages), = quant._PENDING.values()
    assert len(messages) == 2
    check_nonfinite()
