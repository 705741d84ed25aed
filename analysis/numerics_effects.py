"""The numerics study's analysis: per-run summaries, arms and their paired effects against the default
recipe (the method is the module docstring of `analysis.numerics`, the study's report and entry point).

    result = analyze(runs, cfg)          # list[RunHistory] -> NumericsResult (arms, effects, episodes)

Built from the shared parts: per-run values from `analysis.aggregate` (`median_value`, `mean_value`,
`final_value`), seeds ordered by `aggregate.seed_key`, the paired t interval and p-value from `analysis.stats`,
the arms from `analysis.numerics_arms`, matched-kernel runs left out by `analysis.kernel_match`.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from analysis.aggregate import differing_params, final_value, mean_value, median_value, seed_key
from analysis.config import ACCURACY_METRICS, AnalysisConfig
from analysis.fetch import RunHistory
from analysis.kernel_match import only_kernels
from analysis.numerics_arms import (
    HIGHER,
    KNOB_DEFAULTS,
    LOWER,
    NONE,
    TOO_FEW,
    arm_label,
    changed_knobs,
    reference_label,
    reference_text,
    reference_values,
)
from analysis.stats import p_value, t_interval
from fp8rl_core.diagnostics.catalogue import M_GEN_KL
from fp8rl_core.tracking import M_MISMATCH, TAG_SEED, TAIL_FRACTIONS

if TYPE_CHECKING:
    from analysis.numerics_episodes import NumericsEpisodes

NAN = float("nan")


@dataclass(frozen=True)
class Metric:
    """One per-run summary and how its paired effect is shown."""

    key: str  # the field of RunNumerics.values and of the JSON
    label: str
    definition: str
    scale: float = 1.0  # display factor (accuracy: points)
    unit: str = ""  # display unit
    log_ratio: bool = False  # the effect is a difference of log10: shown as a ratio 10^d


MISMATCH_LOG = "mismatch_log10_excess"


def metrics_for(cfg: AnalysisConfig) -> list[Metric]:
    """The metrics in table order; the deciding accuracy metric before the other."""
    acc = [cfg.accuracy_metric, *(m for m in ACCURACY_METRICS if m != cfg.accuracy_metric)]
    return [
        Metric(MISMATCH_LOG, "mismatch excess ratio",
               f"log10(median over steps of {M_MISMATCH} - 1); effect shown as the ratio of excess, arm / default",
               log_ratio=True),
        Metric("mismatch_median", "mismatch median", f"median over steps of {M_MISMATCH}"),
        Metric(M_GEN_KL, M_GEN_KL, f"mean over steps of {M_GEN_KL}"),
        *(Metric(k, "tokens |Δ log p| > " + k.rsplit("_", 1)[-1], f"mean over steps of {k}") for k in TAIL_FRACTIONS),
        *(Metric(f"final_{m}", f"final {m}", f"{m} at the run's last validation step (a fraction; shown in points)",
                 scale=100.0, unit=" pts") for m in acc),
    ]


def figure_metrics(cfg: AnalysisConfig) -> list[str]:
    """Figure 3's panels: mismatch (log ratio), gen_kl, tail > 0.1, the deciding final accuracy."""
    return [MISMATCH_LOG, M_GEN_KL, TAIL_FRACTIONS[0], f"final_{cfg.accuracy_metric}"]



# --- per run ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunNumerics:
    run_id: str
    run_name: str
    status: str
    seed: str
    arm: str
    knobs: dict[str, str]  # the knobs changed from the reference's ({} for the reference arm)
    values: dict[str, float]  # Metric.key -> per-run summary (NaN: not logged)



def summarize_run(run: RunHistory, cfg: AnalysisConfig | None = None) -> RunNumerics:
    cfg = cfg or AnalysisConfig()
    median = median_value(run, M_MISMATCH)
    values = {MISMATCH_LOG: float(np.log10(median - 1)) if median > 1 else NAN, "mismatch_median": median}
    for key in (M_GEN_KL, *TAIL_FRACTIONS):
        values[key] = mean_value(run, key)
    for m in ACCURACY_METRICS:
        values[f"final_{m}"] = final_value(run, m)
    return RunNumerics(run.run_id, run.run_name, run.status, run.get(TAG_SEED) or "?",
                       arm_label(run.params, cfg.reference), changed_knobs(run.params, cfg.reference), values)


# --- per arm ---------------------------------------------------------------------------------------

@dataclass
class Effect:
    """One metric of one arm vs the reference arm: the per-seed differences and their paired t interval."""

    arm: str
    metric: str
    seeds: list[str]
    differences: list[float]
    mean: float
    ci_low: float
    ci_high: float
    sd: float
    p_value: float
    verdict: str

    @property
    def n(self) -> int:
        return len(self.differences)

    def to_dict(self) -> dict:
        return {"arm": self.arm, "metric": self.metric, "n": self.n, "seeds": self.seeds,
                "differences": self.differences, "mean": self.mean, "ci_low": self.ci_low, "ci_high": self.ci_high,
                "sd": self.sd, "p_value": self.p_value, "verdict": self.verdict}


@dataclass
class Arm:
    label: str
    knobs: dict[str, str]
    runs: dict[str, str]  # seed -> run id
    effects: dict[str, Effect] = field(default_factory=dict)  # Metric.key -> Effect (none for the reference)

    @property
    def n_knobs(self) -> int:
        return len(self.knobs)


@dataclass
class NumericsResult:
    arms: list[Arm]  # the reference arm first, then the others ordered by their mismatch effect
    runs: list[RunNumerics]
    metrics: list[Metric]
    confidence: float
    episodes: NumericsEpisodes | None = None  # every run's instability flags (analysis.numerics_episodes)
    reference: dict[str, str] = field(default_factory=dict)  # `analysis.reference` ({}: every knob's default)

    @property
    def base(self) -> str:
        """The reference arm's label: `default` or `reference`."""
        return reference_label(self.reference)

    @property
    def base_text(self) -> str:
        """'the default recipe' or 'the reference (fp8.format=nvfp4 + ...)', for titles and notes."""
        return reference_text(self.reference)

    @property
    def base_arm(self) -> Arm:
        return next(a for a in self.arms if a.label == self.base)

    @property
    def compared(self) -> list[Arm]:
        return [a for a in self.arms if a.label != self.base]

    def seeds_range(self) -> str:
        """'3' or '2–3': the n of the figure's mismatch effects."""
        ns = sorted({a.effects[MISMATCH_LOG].n for a in self.compared})
        return "?" if not ns else str(ns[0]) if len(ns) == 1 else f"{ns[0]}–{ns[-1]}"


def verdict(lo: float, hi: float, n: int) -> str:
    if n < 2 or not (np.isfinite(lo) and np.isfinite(hi)):
        return TOO_FEW
    return HIGHER if lo > 0 else LOWER if hi < 0 else NONE


def paired_effect(arm: str, metric: str, arm_runs: Mapping[str, RunNumerics], base: Mapping[str, RunNumerics],
                  confidence: float) -> Effect:
    """arm − reference per seed both have (finite values only), seeds in sorted order."""
    seeds, d = [], []
    for seed in sorted(set(arm_runs) & set(base), key=seed_key):
        a, b = arm_runs[seed].values[metric], base[seed].values[metric]
        if np.isfinite(a) and np.isfinite(b):
            seeds.append(seed)
            d.append(a - b)
    arr = np.asarray(d, dtype=np.float64)
    mean, lo, hi, sd = (float(x) for x in t_interval(arr, confidence))
    p = float(p_value(arr)) if arr.size else NAN
    return Effect(arm, metric, seeds, d, mean, lo, hi, sd, p, verdict(lo, hi, arr.size))


def _collision(label: str, seed: str, runs: Sequence[RunHistory]) -> ValueError:
    shown = differing_params(runs)
    ids = ", ".join(r.run_id or r.run_name for r in runs)
    return ValueError(f"arm {label!r}, seed {seed}: {len(runs)} runs ({ids}) "
                      f"with the same numerics knobs; they differ in {shown}. A numerics sweep varies only the knobs "
                      f"({', '.join(KNOB_DEFAULTS)}) and the seed")


def _no_reference(reference: Mapping[str, str], by_arm: Mapping[str, object]) -> ValueError:
    found = ", ".join(sorted(by_arm)) or "no runs"
    if not reference:
        defaults = ", ".join(f"{k}={v}" for k, v in KNOB_DEFAULTS.items())
        return ValueError(f"no default arm: no run has every numerics knob at its default ({defaults}); arms found: "
                          f"{found}. The numerics sweep needs a cell with the default recipe to pair every knob with, "
                          "or an analysis.reference naming the arm to pair with")
    wanted = ", ".join(f"{k}={v}" for k, v in reference_values(reference).items())
    return ValueError(f"no reference arm: no run has the knobs of analysis.reference ({wanted}); arms found (labelled "
                      f"by what differs from it): {found}")


def _order_key(arm: Arm) -> tuple:
    e = arm.effects[MISMATCH_LOG].mean
    return (0, -e, arm.label) if np.isfinite(e) else (1, 0.0, arm.label)


def analyze(runs: Sequence[RunHistory], cfg: AnalysisConfig | None = None, episodes: bool = True) -> NumericsResult:
    """Arms, per-run summaries and paired effects of the distinct-kernel `runs` (module docstring), each arm
    against the reference arm (`cfg.reference`, by default every knob at its default), and (`episodes`) every
    run's instability flags with the sensitivity line, which re-runs this without them. ValueError when no run
    is the reference arm or when two runs share an arm and a seed."""
    cfg = cfg or AnalysisConfig()
    every = list(runs)  # the episodes flag matched-kernel runs too (their tags), as the claims report does
    runs = only_kernels(every)
    confidence = 1.0 - cfg.alpha
    summaries = [summarize_run(r, cfg) for r in runs]
    by_arm: dict[str, dict[str, RunNumerics]] = defaultdict(dict)
    source: dict[tuple[str, str], list[RunHistory]] = defaultdict(list)
    for run, s in zip(runs, summaries):
        source[(s.arm, s.seed)].append(run)
        by_arm[s.arm][s.seed] = s
    for (label, seed), group in source.items():
        if len(group) > 1:
            raise _collision(label, seed, group)
    label_of_base = reference_label(cfg.reference)
    if label_of_base not in by_arm:
        raise _no_reference(cfg.reference, by_arm)
    metrics = metrics_for(cfg)
    base = by_arm[label_of_base]
    arms = []
    for label, members in by_arm.items():
        knobs = next(iter(members.values())).knobs
        ids = {seed: members[seed].run_id for seed in sorted(members, key=seed_key)}
        arm = Arm(label, knobs, ids)
        if label != label_of_base:
            arm.effects = {m.key: paired_effect(label, m.key, members, base, confidence) for m in metrics}
        arms.append(arm)
    reference = next(a for a in arms if a.label == label_of_base)
    ordered = sorted((a for a in arms if a is not reference), key=_order_key)
    result = NumericsResult([reference, *ordered], summaries, metrics, confidence, reference=dict(cfg.reference))
    if episodes:
        from analysis.numerics_episodes import numerics_episodes

        # the sensitivity re-runs this analysis on the kept runs, handed in so that the two modules do not import
        # each other
        result.episodes = numerics_episodes(every, result, cfg,
                                            reanalyze=lambda kept: analyze(kept, cfg, episodes=False))
    return result
