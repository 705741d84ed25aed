"""The claims table where the user looks: the terminal, JSON for scripts, Markdown for the report.

    results = check_claims(data, cfg)
    print(format_verdicts(results, cfg))            # `sweep report`
    print(json.dumps(verdicts_json(results, cfg)))  # `sweep report --json`

One row per comparison: claim number, verdict, comparison, effect, interval (the decision's t
interval; claim 4 the TOST interval), the bootstrap interval, n, then the power line under it.
"""
from __future__ import annotations

import textwrap
from collections.abc import Sequence

from analysis.claims import ClaimResult, Comparison, fmt_value
from analysis.config import AnalysisConfig

WIDTH = 100  # the rule paragraph's line width in the terminal
HEAD = ("#", "verdict", "comparison", "effect", "interval", "bootstrap", "n")


def _interval(c: Comparison, pair: tuple[float, float]) -> str:
    lo, hi = (fmt_value(x, c.unit, signed=True) for x in pair)
    return "n/a" if "n/a" in (lo, hi) else f"[{lo}, {hi}] ({c.ci_level:.0%})"


def _cells(r: ClaimResult, c: Comparison | None) -> list[str]:
    if c is None:
        return [str(r.number), r.status, "no paired runs", "n/a", "n/a", "n/a", "0"]
    return [str(r.number), r.status, c.name, fmt_value(c.effect, c.unit, signed=True), _interval(c, c.ci),
            _interval(c, c.bootstrap), str(c.n)]


def rule_text(cfg: AnalysisConfig) -> str:
    return (f"Paired by seed (cells differing only in recipe share prompts); claims 1–2 on per-run median mismatch, "
            f"3–4 on final val accuracy (points). PASS/FAIL: the {1 - cfg.alpha:.0%} t interval of the paired "
            f"difference excludes 0 (level α = {cfg.alpha:g}; claim 1 PASSes only if all its comparisons do, and "
            f"FAILs if one lies below 0 at α/k); claim 4: TOST, PASS iff the {1 - 2 * cfg.alpha:.0%} "
            f"interval lies within ±{cfg.equivalence_margin:g} pts, FAIL iff the {1 - cfg.alpha:.0%} interval lies "
            f"outside it. Bootstrap: percentile, {cfg.bootstrap_resamples} resamples, seed {cfg.seed} (a second view: "
            f"too narrow with few seeds, so it never decides). Power lines assume the observed spread. "
            f"Definitions: analysis/claims.py.")


def format_verdicts(results: Sequence[ClaimResult], cfg: AnalysisConfig | None = None) -> str:
    """A fixed-width table for the terminal: claim titles, one row per comparison, power lines."""
    cfg = cfg or AnalysisConfig()
    rows = [list(HEAD)]
    notes: dict[int, list[str]] = {}
    for r in results:
        for c in (r.comparisons or [None]):
            rows.append(_cells(r, c))
            notes.setdefault(len(rows) - 1, []).append(f"power: {c.power_line}" if c else "")
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEAD))]
    line = lambda row: "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()  # noqa: E731
    out = [f"Claims ({len(results)}): " + "; ".join(f"{r.number} {r.status}" for r in results), ""]
    out.append(line(rows[0]))
    number = None
    for i, row in enumerate(rows[1:], start=1):
        if row[0] != number:
            number = row[0]
            claim = next(r for r in results if str(r.number) == number)
            out.append(f"-- claim {number}: {claim.claim}")
        out.append(line(row))
        out += [f"     {n}" for n in notes.get(i, []) if n]
    out += ["", textwrap.fill(rule_text(cfg), WIDTH)]
    return "\n".join(out)


def verdicts_json(results: Sequence[ClaimResult], cfg: AnalysisConfig | None = None) -> dict:
    """`{"config": {...}, "claims": [ClaimResult.to_dict(), ...]}`; NaN becomes null."""
    cfg = cfg or AnalysisConfig()
    return {"config": cfg.to_dict(), "rule": rule_text(cfg), "claims": [r.to_dict() for r in results]}


def verdicts_markdown(results: Sequence[ClaimResult], cfg: AnalysisConfig | None = None) -> str:
    """The report's claims section: one row per comparison, the evidence and power under the table."""
    cfg = cfg or AnalysisConfig()
    lines = ["| # | claim | verdict | comparison | effect | interval | bootstrap | n | power |",
             "|--:|---|:-:|---|--:|---|---|--:|---|"]
    for r in results:
        for c in (r.comparisons or [None]):
            cells = _cells(r, c)
            lines.append(f"| {r.number} | {r.claim} | **{r.status}** | {' | '.join(cells[2:])} | "
                         f"{c.power_line if c else ''} |")
    lines.append("")
    lines += [f"- Claim {r.number}: {r.statistic}. {r.evidence}." for r in results]
    return "\n".join(lines) + "\n\n" + rule_text(cfg) + "\n"
