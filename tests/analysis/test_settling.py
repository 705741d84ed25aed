"""The settling rule (analysis/settling.py) and the start/end validation read of a run."""
from __future__ import annotations

import numpy as np
import pytest

from analysis.fetch import RunHistory
from analysis.settling import accuracy_start_end, last_half_median, median_interval, settling


def test_last_half_median_takes_the_later_steps_only():
    assert last_half_median(np.array([9.0, 9.0, 9.0, 1.0, 2.0, 3.0])) == 2.0
    assert last_half_median(np.array([9.0, 1.0, 2.0, 3.0, 4.0])) == 3.0  # S = 5: steps 3..5
    assert np.isnan(last_half_median(np.array([])))


def test_stationary_noise_settles():
    rng = np.random.default_rng(0)
    s = settling(1.04 + 0.005 * rng.standard_normal(12))
    assert (s.steps, s.earlier_steps) == (12, 9) and s.settled is True
    lo, hi = s.interval
    assert lo <= s.median <= hi


def test_a_steady_climb_has_not_settled():
    s = settling(np.linspace(1.0, 1.5, 12))  # the last quarter moves the last-half median far past its spread
    assert s.settled is False and s.move > (s.interval[1] - s.interval[0]) / 2


def test_too_few_steps_cannot_be_judged():
    assert settling(np.array([1.0, 1.1, 1.2])).settled is None


def test_median_interval_brackets_the_median_and_collapses_on_constants():
    v = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    lo, hi = median_interval(v)
    assert lo <= np.median(v) <= hi and lo >= v.min() and hi <= v.max()
    assert median_interval(np.array([2.0, 2.0, 2.0])) == (2.0, 2.0)


def test_accuracy_start_end_reads_the_first_and_last_validation():
    run = RunHistory("r", "n", "FINISHED", {}, {}, {
        "val_accuracy": (np.array([0, 6]), np.array([0.25, 0.5])),
    })
    acc = accuracy_start_end(run)
    assert acc["val_accuracy"] == (0.25, 0.5)
    assert all(np.isnan(x) for x in acc["val_accuracy_bf16_eval"])


@pytest.mark.parametrize("n", [4, 5, 8])
def test_the_earlier_estimate_drops_the_last_quarter(n):
    s = settling(np.arange(n, dtype=float))
    assert s.earlier_steps == n - -(-n // 4)
