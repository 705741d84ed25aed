"""Validation split over the ranks (issue 31, M3; fp8rl_core/loop/evaluate.py) on real gloo ranks with the
native engines: every rank generates its share of the held-out batches on the arm's engine and on the BF16
engine, and the all-reduced metrics are those of one rank that ran them all, bit for bit."""
from __future__ import annotations

from _ranks import run_ranks
from _validation_workers import validate

from fp8rl_core.loop.evaluate import VAL_SEED


def test_one_and_two_ranks_give_identical_validation_metrics():
    one = run_ranks(1, validate, [])[0]
    two = run_ranks(2, validate, [])
    metrics = one["metrics"]
    assert set(metrics) == {"val_accuracy", "val_accuracy_greedy", "val_accuracy_bf16_eval"}
    assert all(r["metrics"] == metrics for r in two), (metrics, [r["metrics"] for r in two])
    # 5 prompts: greedy in batches of 4 + 1; 15 sampled rows in 4 + 4 + 4 + 3, seeded VAL_SEED + k
    s = VAL_SEED
    assert one["calls"] == [("arm", 4, None), ("arm", 1, None), ("arm", 4, s), ("arm", 4, s + 1), ("arm", 4, s + 2),
                            ("arm", 3, s + 3), ("bf16", 4, s), ("bf16", 4, s + 1), ("bf16", 4, s + 2),
                            ("bf16", 3, s + 3)]
    # batch i on rank i mod 2: each rank runs its share, and together every batch exactly once
    assert two[0]["calls"] == [one["calls"][i] for i in (0, 2, 4, 6, 8)]
    assert two[1]["calls"] == [one["calls"][i] for i in (1, 3, 5, 7, 9)]
    # the metrics see the samples: not a constant reward (the FP8 arm and the BF16 engine differ in kernels)
    assert 0 < metrics["val_accuracy"] < 1 and len(set(metrics.values())) > 1
