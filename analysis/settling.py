"""Has a run's mismatch settled, and what did validation say at the start and the end? (the real-model study)

**Settled** (issue 32's rule, fixed before the study ran): a run's per-run median over the last half of its
steps moves by less than its own 95% interval when steps are added. With S logged steps, the estimate at S is
m_S = median of the values of steps ⌈S/2⌉+1 .. S; the estimate before the last quarter of the steps was added
is m_S' (S' = S − ⌈S/4⌉, same rule). Settled iff |m_S − m_S'| is below the half-width of m_S's 95% percentile
bootstrap interval (2,000 resamples of the last-half values, fixed seed). With a handful of last-half values
the interval is coarse (it spans their range): a run that moves by more than that range has not settled, one
that stays within it has settled as far as its own noise can tell.

**Accuracy**: the validation metrics at the run's first and last validation step (step 0 and the end in a
study that validates only there): `val_accuracy` (the arm's own generation engine, pass@1 with
`train.val_samples` samples per held-out prompt) and `val_accuracy_bf16_eval` (the BF16 evaluation engine on
the same weights).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from analysis.fetch import RunHistory
from fp8rl_core.tracking import M_MISMATCH
from fp8rl_core.tracking.contract import M_REWARD, M_VAL_ACC, M_VAL_ACC_BF16_EVAL

NAN = float("nan")
CONFIDENCE, RESAMPLES, SEED = 0.95, 2000, 0
ACCURACY_METRICS = (M_VAL_ACC, M_VAL_ACC_BF16_EVAL)


def last_half_median(values: np.ndarray) -> float:
    """Median of the last half of `values` [S] (steps ⌈S/2⌉+1 .. S); NaN when empty."""
    tail = values[len(values) // 2:] if len(values) > 1 else values
    return float(np.median(tail)) if tail.size else NAN


def median_interval(values: np.ndarray) -> tuple[float, float]:
    """95% percentile bootstrap interval of the median of `values` (its value twice when all are equal)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size < 2 or np.ptp(values) == 0:
        v = float(values[0]) if values.size else NAN
        return v, v
    res = stats.bootstrap((values,), np.median, confidence_level=CONFIDENCE, n_resamples=RESAMPLES,
                          method="percentile", rng=np.random.default_rng(SEED))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


@dataclass(frozen=True)
class Settling:
    steps: int  # S
    earlier_steps: int  # S'
    median: float  # m_S
    earlier_median: float  # m_S'
    interval: tuple[float, float]  # m_S's 95% interval

    @property
    def move(self) -> float:
        return abs(self.median - self.earlier_median)

    @property
    def settled(self) -> bool | None:
        """True / False by the rule above; None with fewer than 4 steps (no earlier estimate to compare)."""
        if self.steps < 4 or not math.isfinite(self.move):
            return None
        return self.move < (self.interval[1] - self.interval[0]) / 2


def settling(values: np.ndarray) -> Settling:
    """The settling check of one run's per-step values [S] (steps in order)."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    S = len(values)
    earlier = S - math.ceil(S / 4)
    tail = values[S // 2:] if S > 1 else values
    return Settling(S, earlier, last_half_median(values), last_half_median(values[:earlier]), median_interval(tail))


def run_settling(run: RunHistory, metric: str = M_MISMATCH) -> Settling:
    return settling(run.series(metric)[1])


def accuracy_start_end(run: RunHistory) -> dict[str, tuple[float, float]]:
    """metric -> (value at the first validation step, value at the last); NaN where never logged."""
    out = {}
    for metric in ACCURACY_METRICS:
        _, v = run.series(metric)
        out[metric] = (float(v[0]), float(v[-1])) if v.size else (NAN, NAN)
    return out


def reward_halves(run: RunHistory) -> tuple[float, float]:
    """Mean training reward over the first and over the last half of the run's steps (a learning signal with
    P x G samples a step, beside validation's one sample per held-out prompt); NaN where not logged."""
    v = run.series(M_REWARD)[1]
    v = v[np.isfinite(v)]
    if v.size < 2:
        return NAN, NAN
    h = v.size // 2
    return float(v[:h].mean()), float(v[v.size - h:].mean())
