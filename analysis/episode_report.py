"""The report's instability-episode section: flagged runs, rates per arm, and the sensitivity line.

    sec = episode_section(data.runs, results, cfg)     # results: check_claims(data, cfg)
    print(sec.text())                                   # the terminal block (`sweep report`, claims.txt)
    sec.markdown()                                      # report.md's and claims.md's section
    sec.to_dict()                                       # the JSON verdicts' `episodes`
    sec.sensitivity.line   # 'Sensitivity: leaving out the 1 flagged run (fp8_e2e/token/seed 2), no claim's ...'

Detection and rates: `analysis.episodes` (the band `analysis.episodes`). The sensitivity line re-runs
`check_claims` with the same config on the runs minus the distinct-kernel runs that have an episode
(matched-kernel runs enter no claim) and names each deciding claim whose verdict changes. The claims
pair runs by seed (`summaries.paired`, claim 3's seeds with all three cells): a run left out takes its
pairs with it — claim 4 (one IS setting) loses that seed; claims 1–2, which average a seed's IS
settings, keep the seed through its other settings — and a comparison left with fewer than two pairs is
INCONCLUSIVE, as any claim short of seeds is.
"""
from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from analysis.claims import ClaimResult, check_claims, jsonable
from analysis.config import AnalysisConfig
from analysis.episodes import (
    MERGE_GAP,
    RATE_LEVEL,
    RATE_METHOD,
    ArmRate,
    RunEpisodes,
    arm_rates,
    detect_all,
    ranges_text,
)
from analysis.fetch import RunHistory
from analysis.kernels import DISTINCT

WIDTH = 100  # the terminal block's line width (as the claims' rule paragraph, analysis.verdicts)


@dataclass
class Sensitivity:
    """The claims without the flagged distinct-kernel runs. `changes`: (claim number, before, after)."""

    left_out: list[str]  # labels of the runs left out
    changes: list[tuple[int, str, str]] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)  # the deciding verdicts without them ([]: nothing left out)
    line: str = ""


def sensitivity_line(left_out: Sequence[str], changes: Sequence[tuple[int, str, str]]) -> str:
    """One line: what leaving out the flagged runs does to the deciding verdicts."""
    if not left_out:
        return "Sensitivity: no run is flagged (analysis.episodes), so no verdict rests on a flagged run"
    runs = f"the {len(left_out)} flagged run{'s' * (len(left_out) != 1)} ({', '.join(left_out)})"
    if not changes:
        return f"Sensitivity: leaving out {runs}, no claim's verdict changes"
    what = "; ".join(f"claim {n} changes {a} -> {b}" for n, a, b in changes)
    return f"Sensitivity: leaving out {runs}, {what}"


def sensitivity(runs: Sequence[RunHistory], episodes: Sequence[RunEpisodes], results: Sequence[ClaimResult],
                cfg: AnalysisConfig) -> Sensitivity:
    """`runs` and `episodes` aligned (`detect_all(runs, cfg)`); `results` the deciding verdicts on all
    of `runs`. Re-checks the claims (same `cfg`) on the runs that are not flagged distinct-kernel runs."""
    out = [e.has_episode and e.kernels == DISTINCT for e in episodes]
    left_out = [e.label for e, o in zip(episodes, out) if o]
    if not left_out:
        return Sensitivity([], line=sensitivity_line([], []))
    kept = [r for r, o in zip(runs, out) if not o]
    again = check_claims(kept, cfg)
    changes = [(a.number, a.status, b.status) for a, b in zip(results, again) if a.status != b.status]
    return Sensitivity(left_out, changes, [r.status for r in again], sensitivity_line(left_out, changes))


@dataclass
class EpisodeSection:
    """What every report says about instability episodes (see the module docstring)."""

    cfg: AnalysisConfig
    runs: list[RunEpisodes]  # every child run, distinct and matched, in the data's order
    arms: list[ArmRate]  # distinct-kernel runs per recipe × IS
    sensitivity: Sensitivity

    @property
    def flagged(self) -> list[RunEpisodes]:
        return [e for e in self.runs if e.has_episode]

    def band_text(self) -> str:
        b, metric = self.cfg.episodes, self.cfg.accuracy_metric
        return (f"a run has an instability episode when token_mult_prob_error > {b.mismatch_above:g} on more than "
                f"{b.max_flagged_fraction:.0%} of its steps, or when a validation step's {metric} is more than "
                f"{b.accuracy_drop:g} pts below the run's best earlier validation (analysis.episodes)")

    def text(self) -> str:
        """The terminal block: the band, the rates per arm, one entry per flagged run, the sensitivity line."""
        def fill(text: str, indent: str = "") -> str:
            return textwrap.fill(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")
        rates = "; ".join(f"{'/'.join(a.group.values())} {a.rate.text()}" for a in self.arms) or "no runs"
        lines = [fill(f"Instability episodes: {self.band_text()}."),
                 fill(f"runs with an episode per arm ({RATE_LEVEL:.0%} {RATE_METHOD} interval): {rates}", "  ")]
        lines += [fill(f"flagged: {run_text(e, self.cfg.episodes.mismatch_above)}", "  ") for e in self.flagged]
        if not self.flagged:
            lines.append("  flagged: none")
        return "\n".join([*lines, self.sensitivity.line])

    def markdown(self) -> str:
        """The report's section (no heading): band, rates table, flagged runs table, sensitivity line."""
        band = self.band_text()
        lines = [band[0].upper() + band[1:] + ".", "", *_rates_table(self.arms), ""]
        if self.flagged:
            lines += [*_flagged_table(self.flagged, self.cfg.episodes.mismatch_above), ""]
        else:
            lines += ["No run has an instability episode.", ""]
        return "\n".join([*lines, self.sensitivity.line + ".", ""])

    def to_dict(self) -> dict:
        """The JSON verdicts' `episodes`: band, interval method, arms, every run's flags, sensitivity."""
        return jsonable({"band": asdict(self.cfg.episodes), "accuracy_metric": self.cfg.accuracy_metric,
                         "interval": f"{RATE_LEVEL:.0%} {RATE_METHOD}", "merge_gap": MERGE_GAP,
                         "arms": [a.to_dict() for a in self.arms], "flagged": [e.label for e in self.flagged],
                         "runs": [e.to_dict() for e in self.runs],
                         "sensitivity": {"left_out": self.sensitivity.left_out,
                                         "changes": [{"claim": n, "before": a, "after": b}
                                                     for n, a, b in self.sensitivity.changes],
                                         "statuses": self.sensitivity.statuses, "line": self.sensitivity.line}})


def _rates_table(arms: Sequence[ArmRate]) -> list[str]:
    """Markdown lines: one row per arm (k/n, rate, interval), then what the rate and interval are."""
    keys = list(arms[0].group) if arms else []
    lines = ["| " + " | ".join([*keys, "runs with an episode", "rate", f"{RATE_LEVEL:.0%} interval"]) + " |",
             "|" + "---|" * len(keys) + "--:|--:|---|"]
    for a in arms:
        lo, hi = a.rate.ci
        ci, rate = (f"[{lo:.0%}, {hi:.0%}]", f"{a.rate.rate:.0%}") if a.rate.n else ("–", "–")
        lines.append("| " + " | ".join([*a.group.values(), f"{a.rate.k}/{a.rate.n}", rate, ci]) + " |")
    return lines + ["", f"Rate: the arm's distinct-kernel runs with an episode; interval: {RATE_LEVEL:.0%} "
                        "Clopper–Pearson (exact, `scipy.stats.binomtest(k, n).proportion_ci(method=\"exact\")`)."]


def _flagged_table(flagged: Sequence[RunEpisodes], above: float) -> list[str]:
    """Markdown lines: one row per flagged run, then how to read its episode steps."""
    head = (f"| run | mismatch steps > {above:g} | episode steps | peak mismatch (step) | "
            "worst accuracy drop (step) |")
    return [head, "|---|--:|---|--:|--:|", *(_markdown_row(e) for e in flagged), "",
            f"Episode steps: the flagged mismatch steps as ranges (a range bridges up to {MERGE_GAP} unflagged "
            "steps) when the run has a mismatch episode, then `val` and the validation steps flagged for an "
            "accuracy drop. The same text is each child run's MLflow tag `fp8rl.episode_steps`."]


def _num(x: float, fmt: str, step: int | None, unit: str = "") -> str:
    return "n/a" if not np.isfinite(x) else f"{format(x, fmt)}{unit} ({step})"


def _markdown_row(e: RunEpisodes) -> str:
    return (f"| {e.label} | {e.flagged_steps}/{e.steps} ({e.flagged_fraction:.0%}) | {e.steps_text} | "
            f"{_num(e.peak_mismatch, '.4g', e.peak_step)} | {_num(e.worst_drop, '.1f', e.worst_drop_step, ' pts')} |")


def where_text(e: RunEpisodes) -> str:
    """'steps 54-76 and validation steps 60, 70' (the parts the run has an episode in)."""
    parts = [f"steps {ranges_text(e.ranges)}"] if e.mismatch_episode else []
    if e.accuracy_episode:
        n = len(e.accuracy_steps)
        parts.append(f"validation step{'s' * (n != 1)} " + ", ".join(str(s) for s in e.accuracy_steps))
    return " and ".join(parts) or "no episode"


def run_text(e: RunEpisodes, above: float) -> str:
    """'fp8_e2e/token/seed 2 at steps 54-76 and validation steps 60, 70 (21 of 81 steps above 1.1, peak
    2659 at step 72; worst accuracy drop 41.0 pts at step 60)'; `above`: the band's mismatch_above."""
    peak = f"peak {e.peak_mismatch:.4g} at step {e.peak_step}" if np.isfinite(e.peak_mismatch) else "no mismatch logged"
    drop = (f"; worst accuracy drop {e.worst_drop:.1f} pts at step {e.worst_drop_step}"
            if np.isfinite(e.worst_drop) else "")
    return f"{e.label} at {where_text(e)} ({e.flagged_steps} of {e.steps} steps above {above:g}, {peak}{drop})"


def episode_section(runs: Sequence[RunHistory], results: Sequence[ClaimResult],
                    cfg: AnalysisConfig | None = None) -> EpisodeSection:
    """Detect every run's episodes, the rates per arm, and the claims without the flagged runs."""
    cfg = cfg or AnalysisConfig()
    runs = list(runs)
    eps = detect_all(runs, cfg)
    return EpisodeSection(cfg, eps, arm_rates(runs, cfg), sensitivity(runs, eps, results, cfg))
