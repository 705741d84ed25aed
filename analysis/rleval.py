"""RL-evaluation practice (Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice"):
the interquartile mean (IQM) of final accuracy over runs, and the probability of improvement between
recipes, each with a stratified bootstrap interval (strata = IS settings; runs resampled within each).
Accuracy: the deciding metric (`analysis.accuracy_metric`), as claims 3–4; distinct-kernel runs (the
summaries `summarize_all` makes).

Implemented with scipy (`analysis.stats`), not the `rliable` package: rliable 1.2.0 (an sdist, 2024)
installs beside torch 2.13 without another torch, but pins `arch<8` and brings arch, statsmodels,
seaborn and absl-py for what scipy.stats.bootstrap (several samples = a stratified bootstrap) and
trim_mean do here.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations

import numpy as np

from analysis import stats as st
from analysis.aggregate import IS_ORDER, RECIPE_ORDER
from analysis.config import ACCURACY_LABELS, AnalysisConfig
from analysis.summaries import ACCURACY_ATTR, RunSummary, select


def _ordered(values: set[str], order: Sequence[str]) -> list[str]:
    return sorted(values, key=lambda v: (order.index(v), "") if v in order else (len(order), v))


def _scores(sums: Sequence[RunSummary], recipe: str, isv: str, metric: str) -> np.ndarray:
    x = np.array([getattr(s, ACCURACY_ATTR[metric]) for s in select(sums, recipe, isv)], dtype=np.float64)
    return x[np.isfinite(x)] * 100


def iqm_rows(sums: Sequence[RunSummary], cfg: AnalysisConfig) -> list[dict]:
    """Per recipe × IS and per recipe (all IS settings, stratified): IQM and its interval, in points."""
    rows = []
    recipes = _ordered({s.recipe for s in sums}, RECIPE_ORDER)
    for recipe in recipes:
        settings = _ordered({s.importance_sampling for s in select(sums, recipe)}, IS_ORDER)
        strata = [x for x in (_scores(sums, recipe, v, cfg.accuracy_metric) for v in settings) if x.size]
        groups = [(v, [_scores(sums, recipe, v, cfg.accuracy_metric)]) for v in settings]
        if len(strata) > 1:
            groups.append(("all (stratified)", strata))
        for label, samples in groups:
            samples = [x for x in samples if x.size]
            if not samples:
                continue
            lo, hi = st.stratified_bootstrap(samples, st.pooled_iqm, 1 - cfg.alpha, cfg.bootstrap_resamples, cfg.seed)
            rows.append({"recipe": recipe, "importance_sampling": label, "runs": int(sum(x.size for x in samples)),
                         "iqm": float(st.pooled_iqm(*samples)), "lo": lo, "hi": hi})
    return rows


def improvement_rows(sums: Sequence[RunSummary], cfg: AnalysisConfig) -> list[dict]:
    """P(X > Y) for each pair of recipes, over the IS settings both ran (strata), with its interval."""
    rows = []
    recipes = _ordered({s.recipe for s in sums}, RECIPE_ORDER)
    for y, x in combinations(recipes, 2):  # x: the later recipe in the order (the candidate), y: the reference
        settings = [{s.importance_sampling for s in select(sums, r)} for r in (x, y)]
        shared = _ordered(settings[0] & settings[1], IS_ORDER)
        pairs = [(_scores(sums, x, v, cfg.accuracy_metric), _scores(sums, y, v, cfg.accuracy_metric)) for v in shared]
        flat = [a for xa, ya in pairs if xa.size and ya.size for a in (xa, ya)]
        if not flat:
            continue
        lo, hi = st.stratified_bootstrap(flat, st.probability_of_improvement, 1 - cfg.alpha,
                                         cfg.bootstrap_resamples, cfg.seed)
        rows.append({"x": x, "y": y, "strata": len(flat) // 2, "p": float(st.probability_of_improvement(*flat)),
                     "lo": lo, "hi": hi})
    return rows


def _ci(lo: float, hi: float, fmt: str) -> str:
    return f"[{lo:{fmt}}, {hi:{fmt}}]" if np.isfinite(lo) and np.isfinite(hi) else "n/a"


def rleval_markdown(sums: Sequence[RunSummary], cfg: AnalysisConfig) -> str:
    """The report's two tables (IQM; probability of improvement)."""
    level = f"{1 - cfg.alpha:.0%}"
    what = ACCURACY_LABELS[cfg.accuracy_metric]
    out = [f"| recipe | IS | runs | IQM final {what} (%) | {level} CI (stratified bootstrap) |",
           "|---|---|--:|--:|---|"]
    out += [f"| {r['recipe']} | {r['importance_sampling']} | {r['runs']} | {r['iqm']:.1f} | "
            f"{_ci(r['lo'], r['hi'], '.1f')} |" for r in iqm_rows(sums, cfg)]
    out += ["", f"| X | Y | IS strata | P(X > Y) | {level} CI |", "|---|---|--:|--:|---|"]
    out += [f"| {r['x']} | {r['y']} | {r['strata']} | {r['p']:.2f} | {_ci(r['lo'], r['hi'], '.2f')} |"
            for r in improvement_rows(sums, cfg)]
    note = ("IQM: mean of the middle 50% of runs' final accuracy; P(X > Y): the chance that a run of X beats a run "
            "of Y on the same IS setting (ties ½), averaged over IS settings (Agarwal et al. 2021). Intervals: "
            f"percentile stratified bootstrap, {cfg.bootstrap_resamples} resamples, seed {cfg.seed}.")
    return "\n".join(out) + "\n\n" + note + "\n"
