"""The evaluation engine's part of an accuracy gap: the step-0 offset val_accuracy − val_accuracy_bf16_eval.

    rows = offset_rows(data.runs)          # one dict per recipe, JSON-ready
    text = offset_markdown(rows)           # the report's table

At step 0 every arm holds the same weights (the warm start), and both metrics score the same
validation prompts and samples; they differ only in the generation engine that produced the
answers: the arm's own (`val_accuracy`) or one BF16 engine (`val_accuracy_bf16_eval`). So per run
    o = val_accuracy(step 0) − val_accuracy_bf16_eval(step 0)   (points)
is what the arm's inference precision alone costs (o < 0) or gains, before any training; bf16's o
is 0 by construction (its own engine is the BF16 one). A later accuracy gap larger than o is what
FP8 training did. Per recipe (distinct-kernel runs): o averaged within a seed over its IS settings
first (at step 0 they share weights and prompts, so they are not independent replicates: the seed
is the unit, as in the claims), then the mean over seeds with the 95% Student-t interval; n = seeds.
Runs without `val_accuracy_bf16_eval` (older runs) or without a step-0 value are left out; a recipe
with none is reported `missing`.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from analysis.aggregate import estimate, recipe_rank
from analysis.fetch import RunHistory
from analysis.kernel_match import only_kernels
from fp8rl_core.tracking import M_VAL_ACC, M_VAL_ACC_BF16_EVAL, TAG_RECIPE, TAG_SEED

OFFSET_STEP = 0
CONFIDENCE = 0.95


def _at_step(run: RunHistory, key: str, step: int) -> float:
    steps, values = run.series(key)
    hit = np.flatnonzero(steps == step)
    return float(values[hit[0]]) if hit.size else float("nan")


def step0_offset(run: RunHistory) -> float:
    """val_accuracy − val_accuracy_bf16_eval at step 0, in points; NaN if either is missing there."""
    return 100.0 * (_at_step(run, M_VAL_ACC, OFFSET_STEP) - _at_step(run, M_VAL_ACC_BF16_EVAL, OFFSET_STEP))


def offset_rows(runs: Sequence[RunHistory]) -> list[dict]:
    """Per recipe: `{recipe, mean, ci: [lo, hi], confidence, n (seeds), runs (with a value), missing}`
    (points; NaN mean and `missing: True` when no run of the recipe logged both metrics at step 0)."""
    by_recipe: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    recipes = set()
    for run in only_kernels(runs):
        recipe = run.get(TAG_RECIPE) or "?"
        recipes.add(recipe)
        o = step0_offset(run)
        if np.isfinite(o):
            by_recipe[recipe][run.get(TAG_SEED) or "?"].append(o)
    rows = []
    for recipe in sorted(recipes, key=recipe_rank):
        seeds = by_recipe.get(recipe, {})
        est = estimate([np.mean(v) for v in seeds.values()], CONFIDENCE)
        rows.append({"recipe": recipe, "mean": est.mean, "ci": [est.lo, est.hi], "confidence": CONFIDENCE,
                     "n": est.n, "runs": sum(len(v) for v in seeds.values()), "missing": est.n == 0})
    return rows


def _pts(x: float) -> str:
    return f"{x:+.1f}" if np.isfinite(x) else "n/a"


def offset_markdown(rows: Sequence[dict]) -> str:
    """The report's table; one line when no run logged val_accuracy_bf16_eval."""
    if not rows or all(r["missing"] for r in rows):
        return (f"{M_VAL_ACC_BF16_EVAL}: missing (not logged by these runs), so the evaluation engine's part of "
                f"the accuracy gaps cannot be separated.\n")
    lines = [f"| recipe | step-0 offset {M_VAL_ACC} − {M_VAL_ACC_BF16_EVAL} (pts) | {CONFIDENCE:.0%} t interval | "
             "n (seeds) | runs |", "|---|--:|---|--:|--:|"]
    for r in rows:
        if r["missing"]:
            lines.append(f"| {r['recipe']} | missing | n/a | 0 | 0 |")
            continue
        ci = f"[{_pts(r['ci'][0])}, {_pts(r['ci'][1])}]" if np.isfinite(r["ci"][0]) else "n/a"
        lines.append(f"| {r['recipe']} | {_pts(r['mean'])} | {ci} | {r['n']} | {r['runs']} |")
    note = ("Step 0: identical weights in every arm, so the offset is the arm's own generation engine against one "
            "BF16 engine on the same prompts and samples (< 0: FP8 inference costs accuracy). Per run, then the "
            "mean over a seed's IS settings, then over seeds (Student t; n = seeds).")
    return "\n".join(lines) + "\n\n" + note + "\n"
