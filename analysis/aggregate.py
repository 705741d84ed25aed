"""Align runs on steps, group them by the grid keys minus the seed, and compute mean ± 95% CI.

Confidence interval over the n seeds of a group (Student t, n − 1 degrees of freedom):
    mean = (1/n) Σ_i x_i,   s = sqrt(Σ_i (x_i − mean)² / (n − 1)),
    half = t_{(1+c)/2, n−1} · s / sqrt(n),   CI = [mean − half, mean + half]   (c = 0.95)
n = 1 gives no interval (`half` is NaN: no band is drawn). Per step, n counts the seeds that logged
that step: a seed that stopped early (or a mid-sweep report) leaves later steps with fewer seeds.

Groups default to the tags `recipe` × `importance_sampling` (the study's grid minus the seed); any
tag or param can be a group key (`"tags.X"`, `"params.optim.lr"`, or a bare name: tags first).
Groups are ordered bf16, fp8_gen, fp8_e2e (then others alphabetically) and none-IS first.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from analysis.fetch import RunHistory, SweepData
from fp8rl_core.tracking import TAG_IS, TAG_RECIPE

DEFAULT_GROUP_KEYS = (TAG_RECIPE, TAG_IS)
RECIPE_ORDER = ("bf16", "fp8_gen", "fp8_e2e")
IS_ORDER = ("none", "token", "tis", "icepop", "sequence")
MISSING = "?"


def t_half_width(std: np.ndarray | float, n: np.ndarray | int, confidence: float = 0.95) -> np.ndarray:
    """`t_{(1+c)/2, n−1} · std / sqrt(n)`; NaN where n < 2."""
    n = np.asarray(n, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        t = stats.t.ppf((1 + confidence) / 2, np.where(n >= 2, n - 1, np.nan))
        return np.where(n >= 2, t * np.asarray(std) / np.sqrt(n), np.nan)


def mean_ci(values: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column-wise over finite entries of `values` [R, S]: `(mean [S], half [S], n [S])`."""
    values = np.atleast_2d(np.asarray(values, dtype=np.float64))
    ok = np.isfinite(values)
    n = ok.sum(axis=0)
    x = np.where(ok, values, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, x.sum(axis=0) / n, np.nan)
        sq = np.where(ok, (values - mean) ** 2, 0.0).sum(axis=0)
        std = np.sqrt(np.where(n >= 2, sq / (n - 1), np.nan))
    return mean, t_half_width(std, n, confidence), n


@dataclass
class Estimate:
    """A scalar over seeds: mean and CI half-width (NaN when n < 2)."""

    mean: float
    half: float
    n: int
    values: np.ndarray

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half

    def text(self, digits: int = 4, scale: float = 1.0) -> str:
        if not np.isfinite(self.mean):
            return "n/a"
        head = f"{self.mean * scale:.{digits}f}"
        return f"{head} ± {self.half * scale:.{digits}f}" if np.isfinite(self.half) else head


def estimate(values: Iterable[float], confidence: float = 0.95) -> Estimate:
    arr = np.asarray([v for v in values if np.isfinite(v)], dtype=np.float64)
    mean, half, n = mean_ci(arr.reshape(-1, 1), confidence)
    return Estimate(float(mean[0]) if n[0] else float("nan"), float(half[0]), int(n[0]), arr)


@dataclass
class Curve:
    """One group's history of `key`: union of the runs' steps [S], raw values [R, S] (NaN: missing)."""

    key: str
    group: dict[str, str]
    steps: np.ndarray
    values: np.ndarray
    mean: np.ndarray
    half: np.ndarray
    n: np.ndarray
    run_ids: list[str]

    @property
    def lo(self) -> np.ndarray:
        return self.mean - self.half

    @property
    def hi(self) -> np.ndarray:
        return self.mean + self.half

    @property
    def label(self) -> str:
        return ", ".join(f"{v}" if k == TAG_RECIPE else f"{k.split('.')[-1]}={v}" for k, v in self.group.items())


def recipe_rank(recipe: str) -> tuple:
    """Sort key: bf16, fp8_gen, fp8_e2e, then other recipes alphabetically."""
    return _rank(TAG_RECIPE, recipe)


def _rank(key: str, value: str) -> tuple:
    order = RECIPE_ORDER if key.endswith(TAG_RECIPE) else IS_ORDER if key.endswith(TAG_IS) else ()
    return (order.index(value), "") if value in order else (len(order), value)


def seed_key(seed: str) -> tuple:
    """Seeds in numeric order ("2" before "10"), then any that are not integers, by name."""
    return (0, int(seed), seed) if seed.lstrip("-").isdigit() else (1, 0, seed)


def differing_params(runs: Sequence[RunHistory], shown: int = 6) -> str:
    """The params in which `runs` differ, the first `shown` of them ("none (the same config twice)")."""
    keys = sorted({k for r in runs for k in r.params})
    differ = [k for k in keys if len({r.params.get(k) for r in runs}) > 1]
    return ", ".join(differ[:shown]) + (", ..." if len(differ) > shown else "") or "none (the same config twice)"


def group_runs(runs: Sequence[RunHistory], by: Sequence[str] = DEFAULT_GROUP_KEYS,
               key: Callable[[RunHistory], Sequence[str]] | None = None) -> dict[tuple[str, ...], list[RunHistory]]:
    """Runs grouped by the values of `by` (a run lacking a key goes to value '?'), groups ordered.
    `key`: a run's values of `by` when they are not its tags/params (the numerics study's arm, a
    function of several params: `by=("arm",), key=lambda r: (arm_label(r.params),)`)."""
    groups: dict[tuple[str, ...], list[RunHistory]] = defaultdict(list)
    for run in runs:
        values = key(run) if key is not None else [run.get(k, MISSING) or MISSING for k in by]
        groups[tuple(values)].append(run)
    order = sorted(groups, key=lambda g: tuple(_rank(k, v) for k, v in zip(by, g)))
    return {g: groups[g] for g in order}


def align(runs: Sequence[RunHistory], key: str) -> tuple[np.ndarray, np.ndarray]:
    """`(steps [S], values [R, S])`: the union of the runs' steps, NaN where a run has no value."""
    series = [run.series(key) for run in runs]
    steps = np.unique(np.concatenate([s for s, _ in series])) if series else np.zeros(0, np.int64)
    values = np.full((len(runs), len(steps)), np.nan)
    for i, (s, v) in enumerate(series):
        values[i, np.searchsorted(steps, s)] = v
    return steps.astype(np.int64), values


def curves(data: SweepData | Sequence[RunHistory], key: str, by: Sequence[str] = DEFAULT_GROUP_KEYS,
           confidence: float = 0.95) -> list[Curve]:
    """Mean ± CI of `key` per step for each group that logged it."""
    runs = data.runs if isinstance(data, SweepData) else data
    out = []
    for group, members in group_runs(runs, by).items():
        steps, values = align(members, key)
        if steps.size == 0:
            continue
        mean, half, n = mean_ci(values, confidence)
        out.append(Curve(key, dict(zip(by, group)), steps, values, mean, half, n, [r.run_id for r in members]))
    return out


def final_value(run: RunHistory, key: str) -> float:
    """The value at the run's last logged step of `key` (NaN if never logged)."""
    steps, values = run.series(key)
    return float(values[-1]) if values.size else float("nan")


def mean_value(run: RunHistory, key: str) -> float:
    """The mean over the run's logged steps of `key` (NaN if never logged)."""
    _, values = run.series(key)
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else float("nan")


def median_value(run: RunHistory, key: str) -> float:
    """The median over the run's logged steps of `key` (NaN if never logged): robust to spikes."""
    _, values = run.series(key)
    finite = values[np.isfinite(values)]
    return float(np.median(finite)) if finite.size else float("nan")


def group_estimates(runs: Sequence[RunHistory], key: str, reduce: Callable[[RunHistory, str], float] = final_value,
                    by: Sequence[str] = DEFAULT_GROUP_KEYS, confidence: float = 0.95
                    ) -> dict[tuple[str, ...], Estimate]:
    """Per group: one number per run (`reduce`, e.g. `final_value` or `mean_value`), then mean ± CI."""
    return {g: estimate((reduce(r, key) for r in members), confidence) for g, members in group_runs(runs, by).items()}
