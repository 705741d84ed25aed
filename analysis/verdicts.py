"""The claims table where the user looks: the terminal, JSON for scripts, Markdown for the report.

    results, aside = check_claims(data, cfg), other_accuracy_claims(data, cfg)
    print(format_verdicts(results, cfg, aside))            # `sweep report`
    print(json.dumps(verdicts_json(results, cfg, aside)))  # `sweep report --json`

One row per comparison: claim number, verdict, comparison, effect, interval (the decision's t
interval; claim 4 the TOST interval), the bootstrap interval, n, then the power line under it. A
comparison that does not decide (claim 3's "does not close it") shows its finding in parentheses
instead of the verdict. `aside`: claims 3–4 on the accuracy metric that does not decide, listed
after the deciding ones under their own heading ("not deciding"), never in the first line's tally.
"""
from __future__ import annotations

import textwrap
from collections.abc import Sequence

from analysis.claims import ClaimResult, Comparison, fmt_value, jsonable
from analysis.config import AnalysisConfig

WIDTH = 100  # the rule paragraph's line width in the terminal
HEAD = ("#", "verdict", "comparison", "effect", "interval", "bootstrap", "n")


def _interval(c: Comparison, pair: tuple[float, float]) -> str:
    lo, hi = (fmt_value(x, c.unit, signed=True) for x in pair)
    return "n/a" if "n/a" in (lo, hi) else f"[{lo}, {hi}] ({c.ci_level:.0%})"


def verdict_cell(r: ClaimResult, c: Comparison | None) -> str:
    """The claim's verdict; a non-deciding comparison's finding `(not closed)`; `(PASS)` when the
    claim itself does not decide (the other accuracy metric)."""
    if c is not None and not c.decides:
        return f"({c.finding})"
    return r.status if r.deciding else f"({r.status})"


def _cells(r: ClaimResult, c: Comparison | None) -> list[str]:
    if c is None:
        return [str(r.number), verdict_cell(r, c), "no paired runs", "n/a", "n/a", "n/a", "0"]
    return [str(r.number), verdict_cell(r, c), c.name, fmt_value(c.effect, c.unit, signed=True), _interval(c, c.ci),
            _interval(c, c.bootstrap), str(c.n)]


def rule_text(cfg: AnalysisConfig) -> str:
    return (f"Paired by seed (cells differing only in recipe share prompts); claims 1–2 on per-run median mismatch, "
            f"3–4 on the final {cfg.accuracy_metric} (points; analysis.accuracy_metric). PASS/FAIL: the "
            f"{1 - cfg.alpha:.0%} t interval of the paired difference excludes 0 (level α = {cfg.alpha:g}; "
            f"claim 1 PASSes only if all its comparisons do, and "
            f"FAILs if one lies below 0 at α/k); claim 4: TOST, PASS iff the {1 - 2 * cfg.alpha:.0%} "
            f"interval lies within ±{cfg.equivalence_margin:g} pts, FAIL iff the {1 - cfg.alpha:.0%} interval lies "
            f"outside it. Bootstrap: percentile, {cfg.bootstrap_resamples} resamples, seed {cfg.seed} (a second view: "
            f"too narrow with few seeds, so it never decides). Power lines assume the observed spread. "
            f"Definitions: analysis/claims.py.")


def _aside_heading(aside: Sequence[ClaimResult], cfg: AnalysisConfig) -> str:
    metric = aside[0].metric if aside else cfg.other_accuracy_metric
    return f"not deciding: claims 3–4 on {metric} (analysis.accuracy_metric is {cfg.accuracy_metric})"


def format_verdicts(results: Sequence[ClaimResult], cfg: AnalysisConfig | None = None,
                    aside: Sequence[ClaimResult] = ()) -> str:
    """A fixed-width table for the terminal: claim titles, one row per comparison, power lines;
    then `aside` (claims on the accuracy metric that does not decide) under its own heading."""
    cfg = cfg or AnalysisConfig()
    rows: list[list[str]] = [list(HEAD)]
    owner: list[ClaimResult | None] = [None]  # the claim of each row
    notes: dict[int, list[str]] = {}
    for r in [*results, *aside]:
        for c in (r.comparisons or [None]):
            rows.append(_cells(r, c))
            owner.append(r)
            notes.setdefault(len(rows) - 1, []).append(f"power: {c.power_line}" if c else "")
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEAD))]
    line = lambda row: "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()  # noqa: E731
    out = [f"Claims ({len(results)}): " + "; ".join(f"{r.number} {r.status}" for r in results), ""]
    out.append(line(rows[0]))
    current = None
    for i, row in enumerate(rows[1:], start=1):
        claim = owner[i]
        if claim is not current:
            if not claim.deciding and (current is None or current.deciding):
                out.append(f"== {_aside_heading(aside, cfg)}")
            current = claim
            out.append(f"-- claim {claim.number}: {claim.claim}")
        out.append(line(row))
        out += [f"     {n}" for n in notes.get(i, []) if n]
    out += ["", textwrap.fill(rule_text(cfg), WIDTH)]
    return "\n".join(out)


def verdicts_json(results: Sequence[ClaimResult], cfg: AnalysisConfig | None = None,
                  aside: Sequence[ClaimResult] = (), extra: dict | None = None) -> dict:
    """`{"config": {...}, "rule": ..., "claims": [ClaimResult.to_dict(), ...], "not_deciding": [...],
    **extra}` (`extra`: the report's other JSON-ready tables); NaN becomes null."""
    cfg = cfg or AnalysisConfig()
    out = {"config": cfg.to_dict(), "rule": rule_text(cfg), "claims": [r.to_dict() for r in results],
           "not_deciding": [r.to_dict() for r in aside]}
    return {**out, **jsonable(extra or {})}


def _markdown_rows(results: Sequence[ClaimResult]) -> list[str]:
    lines = ["| # | claim | verdict | comparison | effect | interval | bootstrap | n | power |",
             "|--:|---|:-:|---|--:|---|---|--:|---|"]
    for r in results:
        for c in (r.comparisons or [None]):
            cells = _cells(r, c)
            verdict = f"**{cells[1]}**" if cells[1] == r.status else f"_{cells[1]}_"
            lines.append(f"| {r.number} | {r.claim} | {verdict} | {' | '.join(cells[2:])} | "
                         f"{c.power_line if c else ''} |")
    return lines


def verdicts_markdown(results: Sequence[ClaimResult], cfg: AnalysisConfig | None = None,
                      aside: Sequence[ClaimResult] = ()) -> str:
    """The report's claims section: one row per comparison, the evidence and power under the table;
    then `aside` (the other accuracy metric, not deciding) as a second table."""
    cfg = cfg or AnalysisConfig()
    lines = _markdown_rows(results) + [""]
    lines += [f"- Claim {r.number}: {r.statistic}. {r.evidence}." for r in results]
    if aside:
        heading = _aside_heading(aside, cfg)
        lines += ["", f"{heading[0].upper()}{heading[1:]}.", ""] + _markdown_rows(aside) + [""]
        lines += [f"- Claim {r.number} on {r.metric} (not deciding): {r.statistic}. {r.evidence}." for r in aside]
    return "\n".join(lines) + "\n\n" + rule_text(cfg) + "\n"
