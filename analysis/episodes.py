"""Instability episodes per run, and their rate per arm: pure functions of the runs' histories.

    eps = detect_all(data.runs, cfg)          # list[RunEpisodes], one per run, in the runs' order
    [e.label for e in eps if e.has_episode]   # ['fp8_e2e/token/seed 2']
    arm_rates(data.runs, cfg)                 # list[ArmRate]: k of n runs per recipe × IS, 95% interval

Why: the claims summarize a run by its median mismatch and its final accuracy, so a run that collapses
for twenty steps and recovers (token_mult_prob_error in the thousands, accuracy down 40 points, both back
by the end) leaves every claim as it was. The report flags such runs next to the claims; the claims keep
their statistics (`analysis.claims`), and `analysis.episode_report` re-checks them without the flagged
runs (the sensitivity line).

The band is `analysis.episodes` (`config.EpisodeBand`): τ = `mismatch_above`, f = `max_flagged_fraction`,
δ = `accuracy_drop` (points). Per run (`detect`), over the steps it logged:
- mismatch: the steps t with a logged token_mult_prob_error x_t that is not NaN (S of them; NaN measured
  nothing, so it is neither flagged nor counted; +inf is a blow-up and exceeds any τ). Step t is flagged
  iff x_t > τ; `flagged_fraction` = (flagged steps) / S; the run has a mismatch episode iff it is > f.
  A single spike (1 step of 80, 1.25%) is not an episode under the defaults.
- `ranges`: the flagged steps as contiguous step ranges, "54-76". A range goes on across at most
  MERGE_GAP logged steps that are not flagged (a collapse's mismatch dips under τ for a step or two
  before it is over); steps that were not logged (or NaN) neither end nor extend a range.
- accuracy (`analysis.accuracy_metric`, a fraction a_v at each validation step v with a finite value):
  drop_v = 100 · (max_{u<v} a_u − a_v) points, the fall from the best *earlier* validation (the first
  validation step has none). Step v is flagged iff drop_v > δ, and then the run has an episode.
  `worst_drop` = max_v drop_v (NaN with fewer than two validation steps).
- `has_episode` = mismatch episode or accuracy episode.

Per arm (`arm_rates`: recipe × IS, distinct-kernel runs, as the summary table and the claims group them;
the numerics study passes its own arm, the knob setting, `analysis.numerics_episodes`):
k runs with an episode of n, rate k/n, and its 95% Clopper–Pearson ("exact") interval,
`scipy.stats.binomtest(k, n).proportion_ci(0.95, method="exact")`: with a handful of seeds per arm a
normal approximation (or Wilson's) would under-cover at k = 0 or k = n, which is where these rates sit.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

from analysis.aggregate import DEFAULT_GROUP_KEYS, group_runs
from analysis.config import AnalysisConfig, EpisodeBand
from analysis.fetch import RunHistory
from analysis.kernel_match import DISTINCT, kernels_of, only_kernels
from fp8rl_core.tracking import M_MISMATCH, M_VAL_ACC, TAG_IS, TAG_RECIPE, TAG_SEED

MERGE_GAP = 2  # unflagged logged steps a range may bridge (see the module docstring)
RATE_LEVEL = 0.95  # the rate interval's confidence level
RATE_METHOD = "Clopper–Pearson exact"
NAN = float("nan")


@dataclass(frozen=True)
class RunEpisodes:
    """One run's flags under a band. Steps are the run's RL steps; accuracy drops are in points."""

    recipe: str
    importance_sampling: str
    seed: str
    run_id: str
    kernels: str
    steps: int  # S: logged mismatch steps that are not NaN
    flagged_steps: int  # of them, with x_t > mismatch_above
    ranges: tuple[tuple[int, int], ...]  # the flagged steps as (first, last) step ranges
    peak_mismatch: float  # max_t x_t (NaN: none logged)
    peak_step: int | None
    accuracy_steps: tuple[int, ...]  # validation steps with drop_v > accuracy_drop
    worst_drop: float  # max_v drop_v in points (NaN: fewer than two validation steps)
    worst_drop_step: int | None
    mismatch_episode: bool  # flagged_fraction > max_flagged_fraction
    accuracy_episode: bool  # some validation step flagged

    @property
    def flagged_fraction(self) -> float:
        return self.flagged_steps / self.steps if self.steps else 0.0

    @property
    def has_episode(self) -> bool:
        return self.mismatch_episode or self.accuracy_episode

    @property
    def label(self) -> str:
        """'fp8_e2e/token/seed 2' (+ ', matched kernels' for a floor run)."""
        tail = "" if self.kernels == DISTINCT else f", {self.kernels} kernels"
        return f"{self.recipe}/{self.importance_sampling}/seed {self.seed}{tail}"

    @property
    def steps_text(self) -> str:
        """Where the episode is: '54-76', '54-76; val 60,70', 'val 60', or 'none' (the run has none)."""
        parts = [ranges_text(self.ranges)] if self.mismatch_episode else []
        if self.accuracy_episode:
            parts.append("val " + ",".join(str(s) for s in self.accuracy_steps))
        return "; ".join(parts) or "none"

    def within(self, steps: np.ndarray) -> np.ndarray:
        """The entries of `steps` inside one of the run's mismatch-episode ranges (none without one)."""
        steps = np.asarray(steps, dtype=np.int64)
        if not self.mismatch_episode:
            return steps[:0]
        inside = np.zeros(steps.shape, dtype=bool)
        for first, last in self.ranges:
            inside |= (steps >= first) & (steps <= last)
        return steps[inside]

    def to_dict(self) -> dict:
        """JSON-ready: the fields plus flagged_fraction, has_episode, label and steps_text; NaN -> None."""
        out = asdict(self)
        out["ranges"] = [list(r) for r in self.ranges]
        out["accuracy_steps"] = list(self.accuracy_steps)
        for key in ("peak_mismatch", "worst_drop"):
            out[key] = out[key] if np.isfinite(out[key]) else None
        return {**out, "flagged_fraction": self.flagged_fraction, "has_episode": self.has_episode,
                "label": self.label, "steps_text": self.steps_text}


def step_ranges(steps: np.ndarray, flagged: np.ndarray, gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """`steps` int [S] (the logged steps, ascending), `flagged` bool [S] -> the flagged steps as
    (first, last) step ranges; two flagged steps share a range iff at most `gap` logged steps lie between
    them, i.e. their positions in `steps` differ by at most gap + 1."""
    pos = np.flatnonzero(flagged)
    if pos.size == 0:
        return []
    cut = np.flatnonzero(np.diff(pos) > gap + 1)  # a range ends where the next flagged position is too far
    starts, ends = np.r_[pos[0], pos[cut + 1]], np.r_[pos[cut], pos[-1]]
    return [(int(steps[a]), int(steps[b])) for a, b in zip(starts, ends)]


def ranges_text(ranges: Iterable[tuple[int, int]]) -> str:
    """[(54, 76), (90, 90)] -> '54-76,90' (ASCII: the same text goes into an MLflow tag)."""
    return ",".join(f"{a}-{b}" if b != a else str(a) for a, b in ranges)


def accuracy_drops(values: np.ndarray) -> np.ndarray:
    """`values` [V] (accuracy fractions at the validation steps, finite) -> drop_v [V] in points:
    100 · (max_{u<v} values_u − values_v); NaN at v = 0 (no earlier validation)."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return values
    best_before = np.r_[NAN, np.maximum.accumulate(values)[:-1]]
    return 100.0 * (best_before - values)


def _mismatch(run: RunHistory, band: EpisodeBand) -> dict:
    steps, values = run.series(M_MISMATCH)
    keep = ~np.isnan(values)
    steps, values = steps[keep], values[keep]
    flagged = values > band.mismatch_above
    if values.size == 0:
        return dict(steps=0, flagged_steps=0, ranges=(), peak_mismatch=NAN, peak_step=None, mismatch_episode=False)
    i = int(np.argmax(values))
    return dict(steps=int(values.size), flagged_steps=int(flagged.sum()), ranges=tuple(step_ranges(steps, flagged)),
                peak_mismatch=float(values[i]), peak_step=int(steps[i]),
                mismatch_episode=bool(flagged.mean() > band.max_flagged_fraction))


def _accuracy(run: RunHistory, band: EpisodeBand, metric: str) -> dict:
    steps, values = run.series(metric)
    keep = np.isfinite(values)
    steps, drops = steps[keep], accuracy_drops(values[keep])
    hit = steps[drops > band.accuracy_drop]  # NaN compares False: the first validation step is never hit
    if not np.isfinite(drops).any():
        return dict(accuracy_steps=(), worst_drop=NAN, worst_drop_step=None, accuracy_episode=False)
    i = int(np.nanargmax(drops))
    return dict(accuracy_steps=tuple(int(s) for s in hit), worst_drop=float(drops[i]), worst_drop_step=int(steps[i]),
                accuracy_episode=bool(hit.size))


def detect(run: RunHistory, band: EpisodeBand | None = None, metric: str = M_VAL_ACC) -> RunEpisodes:
    """One run's flags under `band` (default: the default band), accuracy read from `metric`."""
    band = band or EpisodeBand()
    return RunEpisodes(run.get(TAG_RECIPE) or "?", run.get(TAG_IS) or "?", run.get(TAG_SEED) or "?", run.run_id,
                       kernels_of(run), **_mismatch(run, band), **_accuracy(run, band, metric))


def detect_all(runs: Iterable[RunHistory], cfg: AnalysisConfig | None = None) -> list[RunEpisodes]:
    """`detect` for every run (distinct and matched kernels), band `cfg.episodes`, accuracy
    `cfg.accuracy_metric`; in the runs' order."""
    cfg = cfg or AnalysisConfig()
    return [detect(r, cfg.episodes, cfg.accuracy_metric) for r in runs]


@dataclass(frozen=True)
class Rate:
    """k of n runs with an episode; `ci`: the RATE_LEVEL Clopper–Pearson interval of k/n (NaN: n = 0)."""

    k: int
    n: int
    ci: tuple[float, float]

    @property
    def rate(self) -> float:
        return self.k / self.n if self.n else NAN

    def text(self) -> str:
        """'1/3 [1%, 91%]' ('0/0' without runs)."""
        if not self.n:
            return "0/0"
        return f"{self.k}/{self.n} [{self.ci[0]:.0%}, {self.ci[1]:.0%}]"


def episode_rate(episodes: Sequence[RunEpisodes]) -> Rate:
    """k = runs with `has_episode`, n = len(episodes), and the exact binomial interval of k/n."""
    k, n = sum(e.has_episode for e in episodes), len(episodes)
    if n == 0:
        return Rate(0, 0, (NAN, NAN))
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=RATE_LEVEL, method="exact")
    return Rate(k, n, (float(ci.low), float(ci.high)))


@dataclass(frozen=True)
class ArmRate:
    """One arm (a group of distinct-kernel runs, e.g. recipe × IS): its rate and its flagged runs."""

    group: dict[str, str]
    rate: Rate
    flagged: tuple[str, ...]  # the labels of its runs with an episode

    def to_dict(self) -> dict:
        lo, hi = self.rate.ci
        return {**self.group, "k": self.rate.k, "n": self.rate.n,
                "rate": self.rate.rate if self.rate.n else None,
                "ci": [lo, hi] if self.rate.n else [None, None], "flagged": list(self.flagged)}


def arm_rates(runs: Sequence[RunHistory], cfg: AnalysisConfig | None = None,
              by: Sequence[str] = DEFAULT_GROUP_KEYS, key: Callable[[RunHistory], Sequence[str]] | None = None,
              label: Callable[[RunHistory, RunEpisodes], str] | None = None) -> list[ArmRate]:
    """Per group of the distinct-kernel runs (`by`, default recipe × IS, ordered as the summary table):
    the episode rate under `cfg.episodes` and the flagged runs' labels. A study whose arm is not a tag
    (the numerics study's knob setting) passes `key` (a run's values of `by`, `aggregate.group_runs`)
    and `label` (a flagged run's name from the run and its flags; default `RunEpisodes.label`)."""
    cfg = cfg or AnalysisConfig()
    out = []
    for group, members in group_runs(only_kernels(list(runs)), by, key).items():
        eps = detect_all(members, cfg)
        names = tuple(label(r, e) if label else e.label for r, e in zip(members, eps) if e.has_episode)
        out.append(ArmRate(dict(zip(by, group)), episode_rate(eps), names))
    return out


def group_marks(runs: Sequence[RunHistory], by: Sequence[str], band: EpisodeBand | None = None,
                key: str = M_MISMATCH) -> dict[tuple[str, ...], np.ndarray]:
    """The figures' episode markers: per group of `runs` (values of `by`), the sorted steps [M] at which
    one of its runs with an episode was flagged. `key` M_MISMATCH (Figure 1): the flagged mismatch steps
    of runs with a mismatch episode. `key` an accuracy metric (Figure 2): the validation steps of `key`
    flagged for an accuracy drop on `key`, or inside one of the run's mismatch-episode ranges, of runs
    with an episode. A run without an episode marks nothing (an isolated spike is no episode); groups
    without a marked step are left out."""
    band = band or EpisodeBand()
    marks: dict[tuple[str, ...], np.ndarray] = {}
    for group, members in group_runs(runs, by).items():
        hits = [np.zeros(0, np.int64)]
        for run in members:
            e = detect(run, band, M_VAL_ACC if key == M_MISMATCH else key)
            logged, values = run.series(key)
            logged, values = logged[~np.isnan(values)], values[~np.isnan(values)]
            if key == M_MISMATCH and e.mismatch_episode:
                hits.append(logged[values > band.mismatch_above])
            elif key != M_MISMATCH:
                hits += [e.within(logged), np.intersect1d(logged, e.accuracy_steps)]
        steps = np.unique(np.concatenate(hits)).astype(np.int64)
        if steps.size:
            marks[group] = steps
    return marks
