"""The step-0 offset val_accuracy − val_accuracy_bf16_eval per recipe, and older runs without the metric."""
from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from analysis.eval_offset import offset_markdown, offset_rows, step0_offset
from analysis.fetch import RunHistory
from analysis.kernel_match import only_kernels
from analysis.synthetic import EVAL_OFFSET, synthetic_runs


def test_offsets_against_an_independent_computation():
    runs = synthetic_runs(seeds=4, steps=11, bf16_eval=True, matched=("fp8_gen",))
    rows = {r["recipe"]: r for r in offset_rows(runs)}
    assert list(rows) == ["bf16", "fp8_gen", "fp8_e2e"]
    assert rows["bf16"]["mean"] == 0.0 and rows["bf16"]["n"] == 4  # its own engine is the BF16 one
    for recipe in ("fp8_gen", "fp8_e2e"):
        members = [r for r in only_kernels(runs) if r.tags["recipe"] == recipe]  # the matched runs: not replicates
        per_run = {(r.tags["seed"], r.tags["importance_sampling"]):
                   100 * (r.metrics["val_accuracy"][1][0] - r.metrics["val_accuracy_bf16_eval"][1][0]) for r in members}
        per_seed = np.array([np.mean([v for (s, _), v in per_run.items() if s == seed]) for seed in "0123"])
        lo, hi = stats.t.interval(0.95, 3, loc=per_seed.mean(), scale=stats.sem(per_seed))
        row = rows[recipe]
        assert row["mean"] == pytest.approx(per_seed.mean(), rel=1e-12) and row["n"] == 4 and row["runs"] == 8
        assert row["ci"] == pytest.approx([lo, hi], rel=1e-12) and not row["missing"]
        assert lo < 100 * EVAL_OFFSET[recipe] < hi  # the known offset the runs were made with
    text = offset_markdown(list(rows.values()))
    assert "| fp8_gen | " + f"{rows['fp8_gen']['mean']:+.1f} |" in text and "n (seeds)" in text


def test_older_runs_without_the_metric_are_reported_missing():
    runs = synthetic_runs(seeds=2, steps=6)  # no val_accuracy_bf16_eval
    rows = offset_rows(runs)
    assert [r["missing"] for r in rows] == [True] * 3 and all(np.isnan(r["mean"]) for r in rows)
    assert offset_markdown(rows).startswith("val_accuracy_bf16_eval: missing (not logged by these runs)")
    # one recipe logged it, another did not: a row each, the missing one says so
    mixed = synthetic_runs(recipes=("fp8_gen",), seeds=2, steps=6, bf16_eval=True) + runs[:4]
    text = offset_markdown(offset_rows(mixed))
    assert "| bf16 | missing | n/a | 0 | 0 |" in text and "| fp8_gen | " in text


def test_the_offset_is_read_at_step_zero_only():
    steps = np.array([1, 5])
    later = {"val_accuracy": (steps, np.array([0.5, 0.6])), "val_accuracy_bf16_eval": (steps, np.array([0.6, 0.7]))}
    run = RunHistory("r", "", "FINISHED", {"recipe": "fp8_gen", "seed": "0"}, {}, later)
    assert np.isnan(step0_offset(run))  # no step-0 validation: weights already differ between arms
    at0 = {"val_accuracy": 0.25, "val_accuracy_bf16_eval": 0.3}
    run.metrics = {k: (np.r_[0, s], np.r_[at0[k], v]) for k, (s, v) in later.items()}
    assert step0_offset(run) == pytest.approx(-5.0)
