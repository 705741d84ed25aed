"""Aggregation: step alignment, grouping, Student-t 95% CIs against scipy on the raw numbers."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from analysis.aggregate import align, curves, estimate, final_value, group_estimates, group_runs, mean_ci, mean_value
from analysis.fetch import RunHistory, fetch_sweep
from analysis.synthetic import synthetic_runs


def _scipy_ci(x: np.ndarray) -> tuple[float, float, float]:
    """Independent reference: mean and the 95% t interval from scipy."""
    lo, hi = stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=stats.sem(x))
    return float(np.mean(x)), float(lo), float(hi)


def test_curves_from_mlflow_match_scipy_on_the_logged_numbers(sweep_store):
    data = fetch_sweep(sweep_store.uri, sweep_store.experiment, sweep_name=sweep_store.sweep)
    got = {tuple(c.group.values()): c for c in curves(data, "token_mult_prob_error")}
    assert list(got) == [(r, i) for r in ("bf16", "fp8_gen", "fp8_e2e") for i in ("none", "token")]
    for (recipe, isv), curve in got.items():
        truth = [r for r in sweep_store.runs if r.tags["recipe"] == recipe and r.tags["importance_sampling"] == isv]
        matrix = np.stack([r.metrics["token_mult_prob_error"][1] for r in truth])  # [3 seeds, 21 steps]
        np.testing.assert_array_equal(curve.steps, np.arange(21))
        assert (curve.n == 3).all()
        for j in range(matrix.shape[1]):
            mean, lo, hi = _scipy_ci(matrix[:, j])
            assert curve.mean[j] == pytest.approx(mean, rel=1e-12)
            assert curve.lo[j] == pytest.approx(lo, rel=1e-12) and curve.hi[j] == pytest.approx(hi, rel=1e-12)


def test_pooled_recipe_curve_uses_all_runs_of_the_recipe():
    runs = synthetic_runs(seeds=3, steps=5)
    (bf16, *_) = curves(runs, "token_mult_prob_error", by=("recipe",))
    assert bf16.group == {"recipe": "bf16"} and (bf16.n == 6).all()
    matrix = np.stack([r.metrics["token_mult_prob_error"][1] for r in runs if r.tags["recipe"] == "bf16"])
    mean, lo, hi = _scipy_ci(matrix[:, 2])
    assert (bf16.mean[2], bf16.lo[2], bf16.hi[2]) == pytest.approx((mean, lo, hi), rel=1e-12)


def test_align_fills_missing_steps_and_counts_seeds():
    a = RunHistory("a", "a", "FINISHED", {"recipe": "bf16"}, {},
                   {"x": (np.array([0, 1, 2, 3]), np.array([1.0, 2, 3, 4]))})
    b = RunHistory("b", "b", "RUNNING", {"recipe": "bf16"}, {}, {"x": (np.array([0, 2]), np.array([3.0, 5.0]))})
    steps, values = align([a, b], "x")
    np.testing.assert_array_equal(steps, [0, 1, 2, 3])
    np.testing.assert_array_equal(values, [[1, 2, 3, 4], [3, np.nan, 5, np.nan]])
    mean, half, n = mean_ci(values)
    np.testing.assert_array_equal(n, [2, 1, 2, 1])
    np.testing.assert_allclose(mean, [2, 2, 4, 4])
    assert np.isnan(half[[1, 3]]).all()  # one seed: no interval
    assert half[0] == pytest.approx(stats.t.ppf(0.975, 1) * np.std([1, 3], ddof=1) / np.sqrt(2), rel=1e-12)


def test_one_seed_gives_no_band():
    (c, *_) = curves(synthetic_runs(seeds=1, steps=4), "val_accuracy")
    assert (c.n == 1).all() and np.isnan(c.half).all() and np.isfinite(c.mean).all()


def test_estimate_matches_scipy():
    x = np.array([0.61, 0.66, 0.58, 0.70])
    e = estimate(x)
    mean, lo, hi = _scipy_ci(x)
    assert (e.mean, e.lo, e.hi, e.n) == (pytest.approx(mean), pytest.approx(lo), pytest.approx(hi), 4)
    assert estimate([0.5]).n == 1 and np.isnan(estimate([0.5]).half)
    assert estimate([]).n == 0 and np.isnan(estimate([]).mean)
    assert estimate([0.5, float("nan"), 0.7]).n == 2  # a run that never logged the key is left out


def test_group_estimates_reduce_each_run_first():
    runs = synthetic_runs(seeds=3, steps=11)
    finals = group_estimates(runs, "val_accuracy", final_value)
    means = group_estimates(runs, "token_mult_prob_error", mean_value)
    members = [r for r in runs if r.tags["recipe"] == "fp8_gen" and r.tags["importance_sampling"] == "token"]
    expected_final = _scipy_ci(np.array([r.metrics["val_accuracy"][1][-1] for r in members]))
    expected_mean = _scipy_ci(np.array([r.metrics["token_mult_prob_error"][1].mean() for r in members]))
    f, m = finals[("fp8_gen", "token")], means[("fp8_gen", "token")]
    assert (f.mean, f.lo, f.hi) == pytest.approx(expected_final, rel=1e-12)
    assert (m.mean, m.lo, m.hi) == pytest.approx(expected_mean, rel=1e-12)


def test_groups_are_ordered_and_any_key_can_group():
    runs = synthetic_runs(recipes=("zeta", "fp8_e2e", "bf16"), is_variants=("token", "none"), seeds=1, steps=2)
    assert list(group_runs(runs)) == [("bf16", "none"), ("bf16", "token"), ("fp8_e2e", "none"), ("fp8_e2e", "token"),
                                      ("zeta", "none"), ("zeta", "token")]
    by_param = group_runs(runs, by=("params.loss.importance_sampling",))
    assert list(by_param) == [("none",), ("token",)] and len(by_param[("none",)]) == 3
    assert list(group_runs(runs, by=("missing_key",))) == [("?",)]
