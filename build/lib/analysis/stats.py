"""Statistics of the claims: paired t and bootstrap intervals, TOST, power, IQM, probability of improvement.

Vectorized where the claims' decisions are: `d` has shape [..., n] (n paired seeds on the last axis,
any leading axes, e.g. simulated sweeps), so the same code decides one report and 10⁴ simulations.

Paired t (n seeds, per-seed differences d_i):
    d̄ = (1/n) Σ d_i,   s = sqrt(Σ (d_i − d̄)² / (n − 1)),   se = s / √n,
    CI_c = d̄ ± t_{(1+c)/2, n−1} · se.
Power of the two-sided level-α paired t test at a true mean difference δ (noncentral t, ν = n − 1,
λ = δ √n / σ):  power = P(T_{ν,λ} > t_{1−α/2,ν}) + P(T_{ν,λ} < −t_{1−α/2,ν}).
TOST (two one-sided tests at level α, margin m): equivalence iff the (1 − 2α) interval ⊂ (−m, m).
Its power (the usual approximation, exact as σ is known):
    P(T_{ν,λ₁} > t_{1−α,ν}) + P(T_{ν,λ₂} > t_{1−α,ν}) − 1,  λ₁ = (m + δ)√n/σ,  λ₂ = (m − δ)√n/σ.
IQM (Agarwal et al. 2021): the mean of the middle 50% of the scores (scipy.stats.trim_mean(x, 0.25)).
Probability of improvement P(X > Y) = (1/K) Σ_k (1/(n_k m_k)) Σ_i Σ_j S(x_ki, y_kj), S = 1 if >, ½ if =,
over K strata (here IS settings); intervals by the stratified bootstrap (runs resampled within each
stratum: scipy.stats.bootstrap with one sample per stratum and group).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from scipy import optimize, special, stats

PASS_CODE, FAIL_CODE, NONE_CODE = 1, -1, 0
MAX_SEEDS = 100_000


def t_interval(d: np.ndarray, confidence: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`(mean, lo, hi, sd)` over the last axis; NaN interval where n < 2."""
    d = np.asarray(d, dtype=np.float64)
    n = d.shape[-1]
    mean = d.mean(axis=-1) if n else np.full(d.shape[:-1], np.nan)
    if n < 2:
        nan = np.full(np.shape(mean), np.nan)
        return mean, nan, nan, nan
    sd = d.std(axis=-1, ddof=1)
    half = stats.t.ppf((1 + confidence) / 2, n - 1) * sd / np.sqrt(n)
    return mean, mean - half, mean + half, sd


def p_value(d: np.ndarray) -> np.ndarray:
    """Two-sided one-sample t test of mean 0, p = 2 · P(T_{n−1} > |d̄| / se) (= scipy.stats.ttest_1samp);
    NaN where n < 2 or sd = 0."""
    d = np.asarray(d, dtype=np.float64)
    n = d.shape[-1]
    if n < 2:
        return np.full(d.shape[:-1], np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        t = d.mean(axis=-1) / (d.std(axis=-1, ddof=1) / np.sqrt(n))
        return np.where(np.isfinite(t), 2 * special.stdtr(n - 1, -np.abs(t)), np.nan)


def bootstrap_interval(d: np.ndarray, confidence: float, resamples: int, seed: int) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of 1-D `d` (scipy.stats.bootstrap, fixed random state).
    Percentile, not BCa: BCa is undefined for the 2–3 seeds a small study has. NaN where n < 2."""
    d = np.asarray(d, dtype=np.float64)
    if d.size < 2:
        return float("nan"), float("nan")
    if np.ptp(d) == 0:
        return float(d[0]), float(d[0])
    res = stats.bootstrap((d,), np.mean, confidence_level=confidence, n_resamples=resamples,
                          method="percentile", rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def decide_positive(ds: Sequence[np.ndarray], alpha: float) -> np.ndarray:
    """Every mean in `ds` > 0? Each d is [..., n]. PASS (1) iff every (1 − α) t interval lies above 0
    (an intersection–union test: level α/2 with no correction). FAIL (−1) iff some (1 − α/k) interval
    lies below 0 (Bonferroni over the k comparisons: level α/2). So at the null P(PASS or FAIL) ≤ α."""
    k = len(ds)
    lows = np.stack([t_interval(d, 1 - alpha)[1] for d in ds])
    highs = np.stack([t_interval(d, 1 - alpha / k)[2] for d in ds])
    passed = (lows > 0).all(axis=0)
    failed = (highs < 0).any(axis=0)
    return np.where(passed, PASS_CODE, np.where(failed, FAIL_CODE, NONE_CODE))


def tost_intervals(d: np.ndarray, alpha: float) -> tuple[np.ndarray, ...]:
    """`(lo, hi)` of the (1 − 2α) interval (TOST) and `(lo, hi)` of the (1 − α) interval."""
    _, lo90, hi90, _ = t_interval(d, 1 - 2 * alpha)
    _, lo95, hi95, _ = t_interval(d, 1 - alpha)
    return lo90, hi90, lo95, hi95


def decide_equivalence(d: np.ndarray, margin: float, alpha: float) -> np.ndarray:
    """TOST. PASS iff the (1 − 2α) interval ⊂ (−m, m); FAIL iff the (1 − α) interval lies entirely
    outside [−m, m] (the difference is significantly beyond the margin); INCONCLUSIVE otherwise."""
    lo90, hi90, lo95, hi95 = tost_intervals(d, alpha)
    passed = (lo90 > -margin) & (hi90 < margin)
    failed = (lo95 > margin) | (hi95 < -margin)
    return np.where(passed, PASS_CODE, np.where(failed, FAIL_CODE, NONE_CODE))


def t_power(effect: float, sd: float, n: int, alpha: float) -> float:
    """Power of the two-sided level-α paired t test with n seeds at true mean `effect`, spread `sd`."""
    if n < 2 or not np.isfinite(sd) or sd <= 0:
        return float("nan")
    df, ncp = n - 1, abs(effect) * np.sqrt(n) / sd
    tc = special.stdtrit(df, 1 - alpha / 2)  # stats.t.ppf / stats.nct.sf without their per-call overhead
    upper, lower = _nct_sf(tc, df, ncp), _nct_sf(tc, df, -ncp)  # P(T_λ < −c) = P(T_−λ > c): stabler
    return float(np.nan_to_num(upper, nan=1.0) + np.nan_to_num(lower, nan=0.0))


def _nct_sf(x: float, df: float, ncp: float) -> float:
    """P(T > x) for the noncentral t (= stats.nct.sf)."""
    return float(1.0 - special.nctdtr(df, ncp, x))


def min_detectable(sd: float, n: int, alpha: float, power: float) -> float:
    """The smallest |effect| the paired t test detects with probability `power` at n seeds."""
    if n < 2 or not np.isfinite(sd) or sd <= 0:
        return float("nan")
    f = lambda z: t_power(z * sd, sd, n, alpha) - power  # noqa: E731  (z: effect in sd units)
    hi = 1.0
    while f(hi) < 0:
        hi *= 2
    return float(optimize.brentq(f, 0.0, hi, xtol=1e-10) * sd)


def tost_power(effect: float, sd: float, n: int, margin: float, alpha: float) -> float:
    """Approximate power of TOST (see the module docstring) at true difference `effect`."""
    if n < 2 or not np.isfinite(sd) or sd <= 0:
        return float("nan")
    df, tc = n - 1, special.stdtrit(n - 1, 1 - alpha)
    p1 = _nct_sf(tc, df, (margin + effect) * np.sqrt(n) / sd)
    p2 = _nct_sf(tc, df, (margin - effect) * np.sqrt(n) / sd)
    return float(max(0.0, p1 + p2 - 1.0))


def seeds_needed(power_at: Callable[[int], float], power: float, max_n: int = MAX_SEEDS) -> int | None:
    """The smallest n ≥ 2 with `power_at(n) ≥ power` (power grows with n), None beyond `max_n`."""
    if not np.isfinite(power_at(2)):
        return None
    lo, hi = 1, 2  # invariant: power_at(lo) < power (or lo = 1), search the first hi that reaches it
    while power_at(hi) < power:
        lo, hi = hi, hi * 2
        if hi > max_n:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if power_at(mid) >= power else (mid, hi)
    return max(hi, 2)


def iqm(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Interquartile mean: the mean of the middle 50% (scipy.stats.trim_mean with 25% cut per end)."""
    return stats.trim_mean(x, 0.25, axis=axis)


def stratified_bootstrap(samples: Sequence[np.ndarray], statistic: Callable[..., np.ndarray], confidence: float,
                         resamples: int, seed: int) -> tuple[float, float]:
    """Percentile interval of `statistic(*samples, axis=-1)`, each sample resampled on its own (the
    stratified bootstrap of Agarwal et al. 2021). NaN when every sample has one value or fewer."""
    samples = [np.asarray(s, dtype=np.float64) for s in samples]
    if all(s.size < 2 for s in samples) or any(s.size == 0 for s in samples):
        return float("nan"), float("nan")
    if all(np.ptp(s) == 0 for s in samples):
        v = float(statistic(*samples, axis=-1))
        return v, v
    res = stats.bootstrap(samples, statistic, confidence_level=confidence, n_resamples=resamples,
                          method="percentile", vectorized=True, paired=False,
                          rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def pooled_iqm(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
    """IQM of the strata's runs taken together (each sample [..., n_k])."""
    return iqm(np.concatenate(samples, axis=axis), axis=axis)


def _pairwise_superiority(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(1/(n m)) Σ_i Σ_j S(x_i, y_j) over the last axes of x [..., n] and y [..., m]."""
    diff = x[..., :, None] - y[..., None, :]
    return ((diff > 0) + 0.5 * (diff == 0)).mean(axis=(-2, -1))


def probability_of_improvement(*xy: np.ndarray, axis: int = -1) -> np.ndarray:
    """P(X > Y) averaged over strata; `xy` = (x_1, y_1, x_2, y_2, ...), one pair per stratum."""
    assert axis == -1 and len(xy) % 2 == 0
    return np.mean([_pairwise_superiority(xy[i], xy[i + 1]) for i in range(0, len(xy), 2)], axis=0)
