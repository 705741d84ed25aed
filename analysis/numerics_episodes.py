"""Instability episodes in the numerics report: flagged runs, rates per knob setting, sensitivity line.

    sec = analyze(runs, cfg).episodes   # analysis.numerics: this module's NumericsEpisodes
    print(sec.text())                   # the terminal block, after the effects (`sweep report`)
    sec.markdown(), sec.to_dict()       # report.md's and numerics.md's section; numerics.json's `episodes`
    sec.sensitivity.line
    # 'Sensitivity: leaving out the 1 flagged run (fp8.format=nvfp4/seed 2), no knob's verdict changes'

The same detection, rates and section as the claims report (`analysis.episodes`, `analysis.episode_report`,
band `analysis.episodes`), with the numerics study's arm: a run's knob setting (`numerics.arm_label`),
so the rates are k of n runs per knob setting (the reference arm included: `default`, or `reference` under an
`analysis.reference`) and a run is named `<arm>/seed <s>` (the recipe and IS tags are the same in every arm).

Sensitivity: the per-knob paired effects re-run (`numerics.analyze`, same config) on the runs minus the
flagged distinct-kernel runs; every verdict of the table (knob × metric, `numerics.verdict(lo, hi, n)`)
that differs is named. The effects pair by seed, so a flagged knob run takes its seed's pair of that
knob with it and a flagged reference run takes its seed's pair of every knob; a knob left with fewer
than two pairs is `n/a (n < 2)`, and with no reference run left every verdict is.

Figure 3 plots per-knob effects, not per-step curves, so the marks go on the knobs' rows
(`pair_seeds`, `tick`, `figure_note`): a cross on each per-seed difference whose pair holds a flagged
run (the knob's or the default's run of that seed), and "k/n runs flagged" under a knob's row label.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from analysis.config import AnalysisConfig
from analysis.episode_report import NO_FLAGGED, EpisodeSection, left_out_text
from analysis.episodes import RunEpisodes, arm_rates, detect_all
from analysis.fetch import RunHistory
from analysis.kernel_match import DISTINCT, only_kernels
from analysis.numerics_arms import DEFAULT_ARM, TOO_FEW, arm_label, reference_label

if TYPE_CHECKING:  # the result type only: analysis.numerics_effects imports this module
    from analysis.numerics_effects import NumericsResult

ARM = "arm"  # the rates' group key (as numerics.json's arms)
CROSSES = "crosses: seeds whose pair holds a run with an instability episode (analysis.episodes)"


def pair_seeds(flagged_seeds: dict[str, set[str]], arm: str, base: str) -> set[str]:
    """The seeds whose pair (the arm's run − the reference's run) holds a flagged distinct-kernel run."""
    return flagged_seeds.get(arm, set()) | flagged_seeds.get(base, set())


def run_label(run: RunHistory, e: RunEpisodes, reference: dict[str, str] | None = None) -> str:
    """'fp8.format=nvfp4/seed 2' (+ ', matched kernels' for a floor run); labelled against `reference`."""
    tail = "" if e.kernels == DISTINCT else f", {e.kernels} kernels"
    return f"{arm_label(run.params, reference)}/seed {e.seed}{tail}"


def knob_verdicts(result: NumericsResult) -> dict[tuple[str, str], str]:
    """(knob setting, metric key) -> verdict, for every row of the effects table, in its order."""
    return {(a.label, m.key): a.effects[m.key].verdict for a in result.compared for m in result.metrics}


@dataclass
class NumericsSensitivity:
    """The effects without the flagged distinct-kernel runs. `changes`: (knob, metric key, before, after)."""

    left_out: list[str]
    changes: list[tuple[str, str, str, str]] = field(default_factory=list)
    no_default: bool = False  # every reference run was left out: no pair is left
    line: str = ""

    def to_dict(self) -> dict:
        return {"left_out": self.left_out, "no_default": self.no_default, "line": self.line,
                "changes": [{"arm": k, "metric": m, "before": a, "after": b} for k, m, a, b in self.changes]}


def numerics_line(left_out: Sequence[str], changes: Sequence[tuple[str, str, str, str]], labels: dict[str, str],
                  no_default: bool = False, base: str = DEFAULT_ARM) -> str:
    """The claims report's sentence for knobs: 'Sensitivity: leaving out the 1 flagged run (a), no knob's
    verdict changes' / '..., fp8.format=mxfp8 final val_accuracy changes lower -> no detectable difference'.
    `labels`: metric key -> its table label."""
    if not left_out:
        return NO_FLAGGED
    head = f"Sensitivity: leaving out {left_out_text(left_out)}"
    if no_default:
        return f"{head}, no {base} run is left, so every knob's verdict is {TOO_FEW}"
    if not changes:
        return f"{head}, no knob's verdict changes"
    return f"{head}, " + "; ".join(f"{k} {labels.get(m, m)} changes {a} -> {b}" for k, m, a, b in changes)


def numerics_sensitivity(runs: Sequence[RunHistory], episodes: Sequence[RunEpisodes], names: Sequence[str],
                         result: NumericsResult, reanalyze: Callable[[list[RunHistory]], NumericsResult]
                         ) -> NumericsSensitivity:
    """`runs`, `episodes`, `names` aligned; `result` the effects on all of `runs`. Re-runs them without
    the flagged distinct-kernel runs (matched ones never enter an effect) and compares every verdict;
    a knob without pairs then reads `n/a (n < 2)`."""
    out = [e.has_episode and e.kernels == DISTINCT for e in episodes]
    left_out = [name for name, o in zip(names, out) if o]
    if not left_out:
        return NumericsSensitivity([], line=NO_FLAGGED)
    kept = [r for r, o in zip(runs, out) if not o]
    no_default = not any(arm_label(r.params, result.reference) == result.base for r in only_kernels(kept))
    after = {} if no_default else knob_verdicts(reanalyze(kept))  # the analysis needs a reference arm
    changes = [(k, m, a, after.get((k, m), TOO_FEW)) for (k, m), a in knob_verdicts(result).items()
               if a != after.get((k, m), TOO_FEW)]
    labels = {m.key: m.label for m in result.metrics}
    return NumericsSensitivity(left_out, changes, no_default,
                               numerics_line(left_out, changes, labels, no_default, result.base))


@dataclass
class NumericsEpisodes(EpisodeSection):
    """The claims report's section with knob settings as arms, plus what Figure 3 marks."""

    flagged_seeds: dict[str, set[str]] = field(default_factory=dict)  # knob setting -> seeds of its flagged runs
    base: str = DEFAULT_ARM  # the reference arm's label

    def pair_seeds(self, arm: str) -> set[str]:
        """The seeds whose pair (the arm's run − the reference's run) holds a flagged distinct-kernel run."""
        return pair_seeds(self.flagged_seeds, arm, self.base)

    def rate_text(self, arm: str) -> str:
        """'1/3 runs flagged' for an arm with a flagged run, else ''."""
        rate = next((a.rate for a in self.arms if a.group[ARM] == arm), None)
        return f"{rate.k}/{rate.n} runs flagged" if rate is not None and rate.k else ""

    def tick(self, arm: str) -> str:
        """Figure 3's row label suffix: a second line '1/3 runs flagged', or ''."""
        text = self.rate_text(arm)
        return f"\n{text}" if text else ""

    def figure_note(self) -> str:
        """Figure 3's caption line about the crosses ('' when no distinct-kernel run is flagged)."""
        if not self.flagged_seeds:
            return ""
        default = self.rate_text(self.base)
        return CROSSES + (f"; {self.base}: {default}" if default else "")


def numerics_episodes(runs: Sequence[RunHistory], result: NumericsResult, cfg: AnalysisConfig | None,
                      reanalyze: Callable[[list[RunHistory]], NumericsResult]) -> NumericsEpisodes:
    """Detect every run's episodes (`cfg.episodes`), the rates per knob setting (the order of
    `result.arms`), the flagged seeds per setting and the effects without the flagged runs."""
    cfg = cfg or AnalysisConfig()
    runs = list(runs)
    eps = detect_all(runs, cfg)
    ref = result.reference
    names = [run_label(r, e, ref) for r, e in zip(runs, eps)]
    order = {a.label: i for i, a in enumerate(result.arms)}
    rates = sorted(arm_rates(runs, cfg, (ARM,), key=lambda r: (arm_label(r.params, ref),),
                             label=lambda r, e: run_label(r, e, ref)),
                   key=lambda a: order.get(a.group[ARM], len(order)))
    seeds: dict[str, set[str]] = defaultdict(set)
    for r, e in zip(runs, eps):
        if e.has_episode and e.kernels == DISTINCT:
            seeds[arm_label(r.params, ref)].add(e.seed)
    sensitivity = numerics_sensitivity(runs, eps, names, result, reanalyze)
    return NumericsEpisodes(cfg, eps, rates, sensitivity, names, dict(seeds), reference_label(ref))
