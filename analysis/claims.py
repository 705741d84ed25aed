"""The study's four claims, each checked as PASS / FAIL / INCONCLUSIVE with the numbers behind it.

Per run one number: `mismatch` = mean over steps of `token_mult_prob_error`; `accuracy` = the
`val_accuracy` at the run's last validation step. Per group: mean and 95% CI over its runs (Student t,
n − 1 dof; see `aggregate`). "X is below Y" means hi(X) < lo(Y): the CIs are disjoint. Any group
involved with fewer than 2 runs, or missing, makes a claim INCONCLUSIVE.

Groups: bf16 = bf16 runs without IS (the baseline; all bf16 runs if none is without IS).
fp8_gen / fp8_e2e "without IS" = importance_sampling none; "with IS" = the variant `is_variant`
(default: `token` if present, else the first other variant by name).

1. bf16 has the lowest mismatch. Recipes pooled over IS settings (as in Figure 1).
   PASS: hi(bf16) < lo(R) for every other recipe R. FAIL: hi(R) < lo(bf16) for some R.
   INCONCLUSIVE otherwise (an overlap decides nothing).
2. fp8_e2e mismatch < fp8_gen mismatch (pooled over IS).
   PASS: hi(e2e) < lo(gen). FAIL: hi(gen) < lo(e2e). INCONCLUSIVE otherwise.
3. IS narrows fp8_gen's accuracy gap to bf16. A = fp8_gen without IS, B = fp8_gen with IS,
   gap_A = mean(bf16) − mean(A), gap_B = mean(bf16) − mean(B).
   PASS: |gap_B| < |gap_A| and CI(A), CI(B) disjoint (IS moved accuracy beyond noise, towards bf16).
   FAIL: |gap_B| >= |gap_A| and CI(A), CI(B) disjoint. INCONCLUSIVE: CI(A) and CI(B) overlap.
4. fp8_e2e with IS reaches bf16's accuracy. E = fp8_e2e with IS.
   PASS: lo(bf16) <= mean(E) <= hi(bf16). FAIL: CI(E) and CI(bf16) disjoint.
   INCONCLUSIVE: mean(E) outside bf16's CI but the CIs overlap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from analysis.aggregate import Estimate, estimate, final_value, mean_value
from analysis.fetch import RunHistory, SweepData
from fp8rl_core.tracking import M_MISMATCH, M_VAL_ACC

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"


@dataclass
class ClaimResult:
    number: int
    claim: str
    status: str
    evidence: str  # the numbers, e.g. "bf16 1.0041 [1.0032, 1.0050] (n=6); ..."


def _runs(data: SweepData | Sequence[RunHistory]) -> list[RunHistory]:
    return list(data.runs if isinstance(data, SweepData) else data)


def _est(runs: Sequence[RunHistory], key: str, reduce, confidence: float, recipe: str, isv: str | None = None) -> Estimate | None:
    members = [r for r in runs if r.get("recipe") == recipe and (isv is None or r.get("importance_sampling") == isv)]
    return estimate((reduce(r, key) for r in members), confidence) if members else None


def _fmt(name: str, e: Estimate | None, scale: float = 1.0, digits: int = 4) -> str:
    if e is None or e.n == 0:
        return f"{name}: no runs"
    ci = f" [{e.lo * scale:.{digits}f}, {e.hi * scale:.{digits}f}]" if e.n >= 2 else ""
    return f"{name} {e.mean * scale:.{digits}f}{ci} (n={e.n})"


def below(a: Estimate, b: Estimate) -> bool:
    """a's CI entirely below b's."""
    return a.hi < b.lo


def _unusable(*ests: Estimate | None) -> bool:
    return any(e is None or e.n < 2 for e in ests)


def choose_is_variant(runs: Sequence[RunHistory], is_variant: str | None = None) -> str | None:
    variants = sorted({r.get("importance_sampling") for r in runs} - {None, "none"})
    if is_variant is not None:
        return is_variant
    return "token" if "token" in variants else (variants[0] if variants else None)


def claim_lowest_mismatch(runs: Sequence[RunHistory], confidence: float = 0.95) -> ClaimResult:
    recipes = sorted({r.get("recipe") for r in runs} - {None})
    base = _est(runs, M_MISMATCH, mean_value, confidence, "bf16")
    others = {rc: _est(runs, M_MISMATCH, mean_value, confidence, rc) for rc in recipes if rc != "bf16"}
    evidence = "; ".join(_fmt(n, e) for n, e in [("bf16", base), *others.items()]) + " (mean mismatch over steps, 95% CI)"
    if base is None or not others or _unusable(base, *others.values()):
        status = INCONCLUSIVE
    elif any(below(e, base) for e in others.values()):
        status = FAIL
    else:
        status = PASS if all(below(base, e) for e in others.values()) else INCONCLUSIVE
    return ClaimResult(1, "bf16 has the lowest mismatch", status, evidence)


def claim_e2e_below_gen(runs: Sequence[RunHistory], confidence: float = 0.95) -> ClaimResult:
    e2e = _est(runs, M_MISMATCH, mean_value, confidence, "fp8_e2e")
    gen = _est(runs, M_MISMATCH, mean_value, confidence, "fp8_gen")
    evidence = f"{_fmt('fp8_e2e', e2e)}; {_fmt('fp8_gen', gen)} (mean mismatch over steps, 95% CI)"
    if _unusable(e2e, gen):
        status = INCONCLUSIVE
    else:
        status = PASS if below(e2e, gen) else FAIL if below(gen, e2e) else INCONCLUSIVE
    return ClaimResult(2, "fp8_e2e mismatch < fp8_gen mismatch", status, evidence)


def _baseline(runs: Sequence[RunHistory], confidence: float) -> Estimate | None:
    return _est(runs, M_VAL_ACC, final_value, confidence, "bf16", "none") or _est(runs, M_VAL_ACC, final_value, confidence, "bf16")


def claim_is_narrows_gap(runs: Sequence[RunHistory], is_variant: str | None = None, confidence: float = 0.95) -> ClaimResult:
    v = choose_is_variant(runs, is_variant)
    ref = _baseline(runs, confidence)
    a = _est(runs, M_VAL_ACC, final_value, confidence, "fp8_gen", "none")
    b = _est(runs, M_VAL_ACC, final_value, confidence, "fp8_gen", v) if v else None
    claim = f"IS ({v or 'none found'}) narrows fp8_gen's accuracy gap to bf16"
    parts = [_fmt("bf16", ref, 100, 1), _fmt("fp8_gen no IS", a, 100, 1), _fmt(f"fp8_gen IS {v}", b, 100, 1)]
    if _unusable(ref, a, b):
        return ClaimResult(3, claim, INCONCLUSIVE, "; ".join(parts) + " (final val accuracy %, 95% CI)")
    gap_a, gap_b = ref.mean - a.mean, ref.mean - b.mean
    parts.append(f"gap without IS {gap_a * 100:+.1f} pts, with IS {gap_b * 100:+.1f} pts")
    disjoint = below(a, b) or below(b, a)
    status = INCONCLUSIVE if not disjoint else PASS if abs(gap_b) < abs(gap_a) else FAIL
    return ClaimResult(3, claim, status, "; ".join(parts) + " (final val accuracy %, 95% CI)")


def claim_e2e_is_matches_bf16(runs: Sequence[RunHistory], is_variant: str | None = None, confidence: float = 0.95) -> ClaimResult:
    v = choose_is_variant(runs, is_variant)
    ref = _baseline(runs, confidence)
    e = _est(runs, M_VAL_ACC, final_value, confidence, "fp8_e2e", v) if v else None
    claim = f"fp8_e2e + IS ({v or 'none found'}) final accuracy within bf16's CI"
    evidence = f"{_fmt('bf16', ref, 100, 1)}; {_fmt(f'fp8_e2e IS {v}', e, 100, 1)} (final val accuracy %, 95% CI)"
    if _unusable(ref, e):
        status = INCONCLUSIVE
    elif ref.lo <= e.mean <= ref.hi:
        status = PASS
    else:
        status = FAIL if (below(e, ref) or below(ref, e)) else INCONCLUSIVE
    return ClaimResult(4, claim, status, evidence)


def check_claims(data: SweepData | Sequence[RunHistory], is_variant: str | None = None,
                 confidence: float = 0.95) -> list[ClaimResult]:
    runs = _runs(data)
    return [claim_lowest_mismatch(runs, confidence), claim_e2e_below_gen(runs, confidence),
            claim_is_narrows_gap(runs, is_variant, confidence), claim_e2e_is_matches_bf16(runs, is_variant, confidence)]


def claims_markdown(results: Sequence[ClaimResult]) -> str:
    lines = ["| # | claim | result | evidence |", "|--:|---|:-:|---|"]
    for r in results:
        lines.append(f"| {r.number} | {r.claim} | **{r.status}** | {r.evidence} |")
    rule = ("PASS/FAIL need disjoint 95% CIs (Student t over seeds); overlapping CIs or fewer than 2 seeds "
            "give INCONCLUSIVE. Definitions: `analysis/claims.py`.")
    return "\n".join(lines) + "\n\n" + rule + "\n"
