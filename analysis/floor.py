"""The zero-mismatch floor: token_mult_prob_error when the trainer replays the generation engine.

    rows = floor_rows(data.runs)          # one dict per recipe that has matched-kernel runs
    text = floor_markdown(rows)           # the report's "floor" table

Per recipe, over its matched-kernel runs (`engines.kernels: matched`, `analysis.kernel_match`; IS none in
the study's sweep), each run reduced over its logged steps t of x_t = token_mult_prob_error:
- `median` = median_t x_t (as claims 1–2 read the distinct runs);
- `exact_fraction` = (1/S) Σ_t [x_t == 1.0]: no tolerance, because the floor's point is bit-identical
  log-probs (every token's exp(0) = 1 exactly); bf16 and fp8_e2e should read 1, fp8_gen (FP8
  generation, BF16 training) should not;
then the mean over seeds (a seed's runs, e.g. several IS settings, averaged first). Beside it the
same recipe's distinct-kernel median with IS none: the mismatch the study measures above the floor.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from analysis.aggregate import recipe_rank
from analysis.claims import ratio_text
from analysis.fetch import RunHistory
from analysis.kernel_match import DISTINCT, MATCHED, only_kernels
from fp8rl_core.tracking import M_MISMATCH, TAG_IS, TAG_RECIPE, TAG_SEED

NAN = float("nan")


def _per_run(run: RunHistory) -> tuple[float, float]:
    """(median over steps, fraction of steps exactly 1.0); NaN when the run logged no finite step."""
    x = run.series(M_MISMATCH)[1]
    x = x[np.isfinite(x)]
    return (float(np.median(x)), float(np.mean(x == 1.0))) if x.size else (NAN, NAN)


def _mean_over_seeds(pairs: Sequence[tuple[str, float]]) -> tuple[float, int]:
    """(mean over seeds of the seed means, number of seeds) of (seed, value) pairs; NaN values left out."""
    by_seed: dict[str, list[float]] = defaultdict(list)
    for seed, v in pairs:
        if np.isfinite(v):
            by_seed[seed].append(v)
    if not by_seed:
        return NAN, 0
    return float(np.mean([np.mean(v) for v in by_seed.values()])), len(by_seed)


def floor_rows(runs: Sequence[RunHistory]) -> list[dict]:
    """`[{recipe, seeds, runs, median, exact_fraction, distinct_median}]`, recipes in the study's order."""
    matched, distinct = only_kernels(runs, MATCHED), only_kernels(runs, DISTINCT)
    rows = []
    for recipe in sorted({r.get(TAG_RECIPE) or "?" for r in matched}, key=recipe_rank):
        members = [r for r in matched if (r.get(TAG_RECIPE) or "?") == recipe]
        stats = [(r.get(TAG_SEED) or "?", *_per_run(r)) for r in members]
        median, seeds = _mean_over_seeds([(s, m) for s, m, _ in stats])
        exact, _ = _mean_over_seeds([(s, f) for s, _, f in stats])
        twins = [r for r in distinct if r.get(TAG_RECIPE) == recipe and r.get(TAG_IS) == "none"]
        distinct_median, _ = _mean_over_seeds([(r.get(TAG_SEED) or "?", _per_run(r)[0]) for r in twins])
        rows.append({"recipe": recipe, "seeds": seeds, "runs": len(members), "median": median,
                     "exact_fraction": exact, "distinct_median": distinct_median})
    return rows


def _ratio(x: float) -> str:
    if not np.isfinite(x):
        return "n/a"
    return "1 exactly" if x == 1.0 else ratio_text(x)


def floor_markdown(rows: Sequence[dict]) -> str:
    """The floor table, or a line saying the sweep has no matched-kernel runs."""
    if not rows:
        return "No matched-kernel runs (`engines.kernels: matched`) in this sweep: no floor to show.\n"
    lines = ["| recipe | seeds | median mismatch, matched kernels | steps at exactly 1 | "
             "median mismatch, distinct kernels (IS none) |", "|---|--:|--:|--:|--:|"]
    for r in rows:
        exact = f"{r['exact_fraction']:.0%}" if np.isfinite(r["exact_fraction"]) else "n/a"
        lines.append(f"| {r['recipe']} | {r['seeds']} | {_ratio(r['median'])} | {exact} | "
                     f"{_ratio(r['distinct_median'])} |")
    note = ("Matched kernels: the trainer's log-prob pass replays the generation engine's computation, so what is "
            "left is the precision gap alone (bf16 and fp8_e2e: none). Per run the median over steps of "
            "token_mult_prob_error and the fraction of steps at exactly 1.0, then the mean over seeds; these runs "
            "enter no claim, table row or Figure 2 (Figure 1: dashed).")
    return "\n".join(lines) + "\n\n" + note + "\n"
