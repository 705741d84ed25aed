"""Matched-kernel runs: one grouping key (`kernels_of`), kept out of the claims, tabled as the floor."""
from __future__ import annotations

import numpy as np
import pytest

from analysis.claims import check_claims
from analysis.config import AnalysisConfig
from analysis.fetch import RunHistory, SweepData
from analysis.floor import floor_markdown, floor_rows
from analysis.kernel_match import DISTINCT, KERNELS_PARAM, MATCHED, kernels_of, only_kernels
from analysis.summaries import summarize_all
from analysis.synthetic import synthetic_runs

CFG = AnalysisConfig(bootstrap_resamples=200)


@pytest.fixture(scope="module")
def runs() -> list[RunHistory]:
    return synthetic_runs(seeds=3, steps=21, matched=("bf16", "fp8_gen", "fp8_e2e"))


def test_kernels_of_reads_the_param_and_older_runs_are_distinct(runs):
    assert {kernels_of(r) for r in runs} == {DISTINCT, MATCHED}
    assert all(kernels_of(r) == MATCHED for r in runs if r.tags["cell_id"].endswith("-matched"))
    legacy = RunHistory("x", "", "FINISHED", {"recipe": "bf16"}, {"seed": "0"})  # logged before the key existed
    assert kernels_of(legacy) == DISTINCT
    assert len(only_kernels(runs)) == 18 and len(only_kernels(runs, MATCHED)) == 9
    data = SweepData("u", "1", "s", None, runs)
    assert isinstance(only_kernels(data, MATCHED), SweepData) and len(only_kernels(data, MATCHED).runs) == 9
    with pytest.raises(ValueError, match="kernels: 'same' is invalid; expected one of: distinct, matched"):
        only_kernels(runs, "same")


def test_claims_and_summaries_ignore_matched_runs(runs):
    distinct = only_kernels(runs)
    assert len(summarize_all(runs)) == 18 and {s.run_id for s in summarize_all(runs)} == \
        {s.run_id for s in summarize_all(distinct)}
    with_floor, without = check_claims(runs, CFG), check_claims(distinct, CFG)
    assert [r.status for r in with_floor] == [r.status for r in without]
    assert [c.ci for r in with_floor for c in r.comparisons] == [c.ci for r in without for c in r.comparisons]
    assert [o["fraction"] for o in with_floor[0].step_order] == [o["fraction"] for o in without[0].step_order]
    # a matched run that would flip claim 1 if it were paired with bf16's distinct cells changes nothing
    loud = [RunHistory(r.run_id, r.run_name, r.status, r.tags, r.params,
                       {**r.metrics, "token_mult_prob_error": (r.metrics["token_mult_prob_error"][0],
                                                               np.full(21, 50.0))})
            if kernels_of(r) == MATCHED and r.tags["recipe"] == "bf16" else r for r in runs]
    assert [r.status for r in check_claims(loud, CFG)] == [r.status for r in without]


def test_floor_rows_against_the_logged_values(runs):
    rows = {r["recipe"]: r for r in floor_rows(runs)}
    assert list(rows) == ["bf16", "fp8_gen", "fp8_e2e"]
    for recipe in ("bf16", "fp8_e2e"):  # the trainer replays the generation engine: 1 exactly, every step
        assert rows[recipe]["median"] == 1.0 and rows[recipe]["exact_fraction"] == 1.0 and rows[recipe]["seeds"] == 3
    gen = [r for r in runs if kernels_of(r) == MATCHED and r.tags["recipe"] == "fp8_gen"]
    medians = [np.median(r.metrics["token_mult_prob_error"][1]) for r in gen]
    assert rows["fp8_gen"]["median"] == pytest.approx(np.mean(medians), rel=1e-12)
    assert rows["fp8_gen"]["exact_fraction"] == 0.0
    twins = [r for r in only_kernels(runs) if r.tags["recipe"] == "fp8_gen" and r.tags["importance_sampling"] == "none"]
    assert rows["fp8_gen"]["distinct_median"] == pytest.approx(
        np.mean([np.median(r.metrics["token_mult_prob_error"][1]) for r in twins]), rel=1e-12)


def test_exact_fraction_counts_steps_at_exactly_one():
    steps = np.arange(4)
    run = RunHistory("m", "", "FINISHED", {"recipe": "fp8_gen", "importance_sampling": "none", "seed": "0"},
                     {KERNELS_PARAM: MATCHED}, {"token_mult_prob_error": (steps, np.array([1.0, 1.0, 1 + 1e-12, 1.2]))})
    (row,) = floor_rows([run])
    assert row["exact_fraction"] == 0.5 and row["median"] == pytest.approx(1 + 0.5e-12)
    assert np.isnan(row["distinct_median"])  # no distinct twin in this sweep


def test_floor_markdown(runs):
    text = floor_markdown(floor_rows(runs))
    bf16 = next(line for line in text.splitlines() if line.startswith("| bf16 |"))
    assert "| 3 | 1 exactly | 100% |" in bf16
    gen = next(line for line in text.splitlines() if line.startswith("| fp8_gen |"))
    assert "| 0% |" in gen and "1 exactly" not in gen
    assert "No matched-kernel runs" in floor_markdown(floor_rows(only_kernels(runs)))
