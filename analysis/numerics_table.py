"""The numerics study's tables: the paired effects per knob × metric (numerics.md, report.md) and the
terminal summary, in display units (the mismatch effect as a ratio of excess, accuracy in points).

    markdown_table(result)                        # one row per arm × metric: n, effect, interval, verdict
    verdicts_text(result, figure_metrics(cfg))    # one line per arm with its figure metrics
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from analysis.numerics_arms import reference_settings
from analysis.numerics_effects import MISMATCH_LOG, Arm, Metric, NumericsResult


def fmt_effect(x: float, m: Metric, signed: bool = True) -> str:
    if not np.isfinite(x):
        return "n/a"
    if m.log_ratio:
        return f"×{10 ** x:.3g}"
    v = x * m.scale
    spec = ("+" if signed else "") + (".2f" if m.unit else ".3g")
    return format(v, spec) + m.unit


def arm_cell(arm: Arm) -> str:
    return f"{arm.label} ({arm.n_knobs} knobs)" if arm.n_knobs > 1 else arm.label


def markdown_table(result: NumericsResult) -> str:
    """One row per arm × metric: n, effect (arm − reference arm), interval, verdict."""
    pct, base = f"{result.confidence:.0%}", result.base
    lines = [f"| knob | metric | n | effect (knob − {base}) | {pct} CI | verdict |", "|---|---|--:|--:|---|---|"]
    for arm in result.compared:
        for m in result.metrics:
            e = arm.effects[m.key]
            ci = "n/a" if not np.isfinite(e.ci_low) else f"[{fmt_effect(e.ci_low, m)}, {fmt_effect(e.ci_high, m)}]"
            label = m.label.replace("|", "\\|")  # |Δ log p| inside a table cell
            lines.append(f"| {arm_cell(arm)} | {label} | {e.n} | {fmt_effect(e.mean, m)} | {ci} | {e.verdict} |")
    ref = f" ({base}: {reference_settings(result.reference)})" if result.reference else ""
    note = (f"Paired by seed: per seed the knob's run minus the {base} run ({len(result.base_arm.runs)} {base} runs)"
            f"{ref}. "
            f"Effect: the mean difference, with the {pct} paired t interval over n seeds; verdict higher / lower when "
            "the interval excludes 0, else no detectable difference. Mismatch excess ratio: the paired difference of "
            "log10(median token_mult_prob_error − 1), shown as the ratio of excess mismatch (×1 = no effect). "
            "Accuracy in points. Rows with (2 knobs): a cell that changed two knobs at once (their joint effect).")
    return "\n".join(lines) + "\n\n" + note + "\n"


def verdicts_text(result: NumericsResult, figure: Sequence[str]) -> str:
    """The terminal summary: one line per arm with its figure metrics."""
    by_key = {m.key: m for m in result.metrics}
    out = [f"Numerics (paired by seed vs {result.base}, {result.confidence:.0%} t intervals):"]
    for arm in result.compared:
        parts = []
        for key in figure:
            e, m = arm.effects[key], by_key[key]
            ci = "" if not np.isfinite(e.ci_low) else f" [{fmt_effect(e.ci_low, m)}, {fmt_effect(e.ci_high, m)}]"
            parts.append(f"{m.label} {fmt_effect(e.mean, m)}{ci} {e.verdict}")
        out.append(f"  {arm_cell(arm)} (n={arm.effects[MISMATCH_LOG].n}): " + "; ".join(parts))
    return "\n".join(out)
