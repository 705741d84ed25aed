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

The numerics report builds the same section (`analysis.numerics_episodes`): its arms are knob settings,
its runs named by arm and seed (`labels`), its sensitivity re-runs the paired effects; `tag_runs`
writes the child runs' tags for both reports.
"""
from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

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
from analysis.kernel_match import DISTINCT
from fp8rl_core.tracking import TAG_EPISODE, TAG_EPISODE_STEPS
from fp8rl_core.tracking.store import set_tags

WIDTH = 100  # the terminal block's line width (as the claims' rule paragraph, analysis.verdicts)
NO_FLAGGED = "Sensitivity: no run is flagged (analysis.episodes), so no verdict rests on a flagged run"


class SensitivityView(Protocol):
    """What the section reads of a sensitivity check (the claims' `Sensitivity`, the numerics one)."""

    left_out: list[str]
    line: str

    def to_dict(self) -> dict: ...


@dataclass
class Sensitivity:
    """The claims without the flagged distinct-kernel runs. `changes`: (claim number, before, after)."""

    left_out: list[str]  # labels of the runs left out
    changes: list[tuple[int, str, str]] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)  # the deciding verdicts without them ([]: nothing left out)
    line: str = ""

    def to_dict(self) -> dict:
        changes = [{"claim": n, "before": a, "after": b} for n, a, b in self.changes]
        return {"left_out": self.left_out, "changes": changes, "statuses": self.statuses, "line": self.line}


def left_out_text(left_out: Sequence[str]) -> str:
    """'the 2 flagged runs (a, b)'."""
    return f"the {len(left_out)} flagged run{'s' * (len(left_out) != 1)} ({', '.join(left_out)})"


def sensitivity_line(left_out: Sequence[str], changes: Sequence[tuple[int, str, str]]) -> str:
    """One line: what leaving out the flagged runs does to the deciding verdicts."""
    if not left_out:
        return NO_FLAGGED
    if not changes:
        return f"Sensitivity: leaving out {left_out_text(left_out)}, no claim's verdict changes"
    what = "; ".join(f"claim {n} changes {a} -> {b}" for n, a, b in changes)
    return f"Sensitivity: leaving out {left_out_text(left_out)}, {what}"


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
    arms: list[ArmRate]  # distinct-kernel runs per arm (recipe × IS; the numerics report: knob setting)
    sensitivity: SensitivityView
    labels: list[str] = field(default_factory=list)  # the runs' names, aligned with `runs` ([]: RunEpisodes.label)

    @property
    def flagged(self) -> list[RunEpisodes]:
        return [e for e in self.runs if e.has_episode]

    def named(self) -> list[tuple[RunEpisodes, str]]:
        """(flags, name) per run; the name is `labels`' entry, else `RunEpisodes.label`."""
        return list(zip(self.runs, self.labels or [e.label for e in self.runs]))

    def flagged_named(self) -> list[tuple[RunEpisodes, str]]:
        return [(e, name) for e, name in self.named() if e.has_episode]

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
        above = self.cfg.episodes.mismatch_above
        lines += [fill(f"flagged: {run_text(e, above, name)}", "  ") for e, name in self.flagged_named()]
        if not self.flagged:
            lines.append("  flagged: none")
        return "\n".join([*lines, self.sensitivity.line])

    def markdown(self) -> str:
        """The report's section (no heading): band, rates table, flagged runs table, sensitivity line."""
        band = self.band_text()
        lines = [band[0].upper() + band[1:] + ".", "", *_rates_table(self.arms), ""]
        if self.flagged:
            lines += [*_flagged_table(self.flagged_named(), self.cfg.episodes.mismatch_above), ""]
        else:
            lines += ["No run has an instability episode.", ""]
        return "\n".join([*lines, self.sensitivity.line + ".", ""])

    def to_dict(self) -> dict:
        """The JSON verdicts' `episodes`: band, interval method, arms, every run's flags, sensitivity."""
        return jsonable({"band": asdict(self.cfg.episodes), "accuracy_metric": self.cfg.accuracy_metric,
                         "interval": f"{RATE_LEVEL:.0%} {RATE_METHOD}", "merge_gap": MERGE_GAP,
                         "arms": [a.to_dict() for a in self.arms],
                         "flagged": [name for _, name in self.flagged_named()],
                         "runs": [{**e.to_dict(), "label": name} for e, name in self.named()],
                         "sensitivity": self.sensitivity.to_dict()})


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


def _flagged_table(flagged: Sequence[tuple[RunEpisodes, str]], above: float) -> list[str]:
    """Markdown lines: one row per flagged run (flags, name), then how to read its episode steps."""
    head = (f"| run | mismatch steps > {above:g} | episode steps | peak mismatch (step) | "
            "worst accuracy drop (step) |")
    return [head, "|---|--:|---|--:|--:|", *(_markdown_row(e, name) for e, name in flagged), "",
            f"Episode steps: the flagged mismatch steps as ranges (a range bridges up to {MERGE_GAP} unflagged "
            "steps) when the run has a mismatch episode, then `val` and the validation steps flagged for an "
            "accuracy drop. The same text is each child run's MLflow tag `fp8rl.episode_steps`."]


def _num(x: float, fmt: str, step: int | None, unit: str = "") -> str:
    return "n/a" if not np.isfinite(x) else f"{format(x, fmt)}{unit} ({step})"


def _drop(e: RunEpisodes) -> str:
    """The worst accuracy drop, or "none" when accuracy never fell below an earlier validation (a
    negative "drop" is a rise, which reads as a fall)."""
    return _num(e.worst_drop, ".1f", e.worst_drop_step, " pts") if not e.worst_drop <= 0 else "none"


def _markdown_row(e: RunEpisodes, name: str) -> str:
    return (f"| {name} | {e.flagged_steps}/{e.steps} ({e.flagged_fraction:.0%}) | {e.steps_text} | "
            f"{_num(e.peak_mismatch, '.4g', e.peak_step)} | {_drop(e)} |")


def where_text(e: RunEpisodes) -> str:
    """'steps 54-76 and validation steps 60, 70' (the parts the run has an episode in)."""
    parts = [f"steps {ranges_text(e.ranges)}"] if e.mismatch_episode else []
    if e.accuracy_episode:
        n = len(e.accuracy_steps)
        parts.append(f"validation step{'s' * (n != 1)} " + ", ".join(str(s) for s in e.accuracy_steps))
    return " and ".join(parts) or "no episode"


def run_text(e: RunEpisodes, above: float, name: str | None = None) -> str:
    """'fp8_e2e/token/seed 2 at steps 54-76 and validation steps 60, 70 (21 of 81 steps above 1.1, peak
    2659 at step 72; worst accuracy drop 41.0 pts at step 60)'; `above`: the band's mismatch_above;
    `name`: the run's name (default `e.label`)."""
    peak = f"peak {e.peak_mismatch:.4g} at step {e.peak_step}" if np.isfinite(e.peak_mismatch) else "no mismatch logged"
    drop = (f"; worst accuracy drop {e.worst_drop:.1f} pts at step {e.worst_drop_step}"
            if np.isfinite(e.worst_drop) and e.worst_drop > 0 else "")
    return f"{name or e.label} at {where_text(e)} ({e.flagged_steps} of {e.steps} steps above {above:g}, {peak}{drop})"


def episode_section(runs: Sequence[RunHistory], results: Sequence[ClaimResult],
                    cfg: AnalysisConfig | None = None) -> EpisodeSection:
    """Detect every run's episodes, the rates per arm, and the claims without the flagged runs."""
    cfg = cfg or AnalysisConfig()
    runs = list(runs)
    eps = detect_all(runs, cfg)
    return EpisodeSection(cfg, eps, arm_rates(runs, cfg), sensitivity(runs, eps, results, cfg))


def tag_runs(client, runs: Iterable[RunEpisodes]) -> None:
    """`fp8rl.episode` = true/false and `fp8rl.episode_steps` on every child run (one batch each;
    `client`: a `fp8rl_core.tracking.store.Store`): the runs table can then filter on them. Rewritten
    by each report (a mid-sweep run may get one later); a run without an id (in memory) is skipped."""
    for e in runs:
        if e.run_id:
            set_tags(client, e.run_id, {TAG_EPISODE: str(e.has_episode).lower(), TAG_EPISODE_STEPS: e.steps_text})
