"""The study's four claims, each decided PASS / FAIL / INCONCLUSIVE by a paired test at level α.

Unit of replication: the seed. Cells that differ only in recipe share a seed's prompts, so every
comparison uses per-seed paired differences d_s (see `summaries.paired`), with a (1 − α) Student t
interval (the decision), a percentile bootstrap interval (scipy.stats.bootstrap, fixed seed: a
second view), n, a p-value, and a power line (`power_line`). α, the margin and the bootstrap come
from `AnalysisConfig`. Per-run summaries (`summaries`, distinct-kernel runs only: the matched-kernel
floor is no arm of the study): mismatch = the median over steps of `token_mult_prob_error` (robust to
the heavy-tailed spikes; the trimmed mean is shown beside it); accuracy = the `analysis.accuracy_metric`
(`val_accuracy` or `val_accuracy_bf16_eval`) at the run's last validation step.

1. bf16 has the lowest mismatch. For each other recipe R: d_s = median(R) − median(bf16), pooled over
   IS settings (a seed's IS pairs averaged). PASS iff every (1 − α) interval lies above 0; FAIL iff
   some (1 − α/k) interval lies below 0 (k other recipes; `stats.decide_positive`). The fraction of
   steps at which bf16 is below R (paired step by step, per seed) is reported beside it.
2. fp8_e2e mismatch < fp8_gen mismatch: d_s = median(fp8_gen) − median(fp8_e2e); same rule, k = 1.
3. IS narrows fp8_gen's accuracy gap to bf16. A = fp8_gen without IS, B = fp8_gen with IS, bf16 the
   baseline (without IS). |gap_B| < |gap_A| ⟺ sgn · (B − A) > 0 with sgn = sign(bf16 − (A + B)/2)
   (the direction towards bf16, measured from the midpoint so that it is independent of B − A under
   the null). d_s = sgn · (B_s − A_s); PASS iff its (1 − α) interval lies above 0, FAIL iff below.
   "...but does not close it" is a second comparison, shown and not deciding: the gap left with IS,
   g_s = sgn₀ · (bf16_s − B_s) with sgn₀ = sign(mean_s(bf16_s − A_s)) (the gap's side without IS), and
   its (1 − α) interval: above 0 "not closed", below 0 "overshot", else "closing not excluded". It
   does not enter the verdict, which stays the one test whose error rates tests/analysis/
   test_claim_error_rates.py checks: folding it in (PASS iff both intervals exclude 0, an
   intersection–union test) would keep the level but cost power, and would turn a claim 3 that IS
   fully closes into INCONCLUSIVE rather than say so; the finding beside the verdict says it instead.
4. fp8_e2e + IS matches bf16: d_s = E_s − bf16_s (bf16 with the same IS setting when it ran, else
   bf16 without IS). TOST with margin m = `equivalence_margin` points: PASS iff the (1 − 2α)
   interval ⊂ (−m, m); FAIL iff the (1 − α) interval lies outside [−m, m]; INCONCLUSIVE otherwise.
Fewer than 2 paired seeds: INCONCLUSIVE (no interval). `other_accuracy_claims` repeats 3–4 on the
accuracy metric that does not decide (`deciding=False`), when the runs logged it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from analysis import stats as st
from analysis.aggregate import recipe_rank
from analysis.config import AnalysisConfig
from analysis.fetch import RunHistory, SweepData
from analysis.summaries import (
    ACCURACY_ATTR,
    RunSummary,
    accuracy_logged,
    paired,
    select,
    step_order_fractions,
    summarize_all,
)
from fp8rl_core.tracking import TAG_IS

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
VERDICT = {st.PASS_CODE: PASS, st.FAIL_CODE: FAIL, st.NONE_CODE: INCONCLUSIVE}
MISMATCH_UNIT, ACC_UNIT = "", "pts"


@dataclass
class Comparison:
    """One paired comparison: d_s per seed, its mean, intervals and power. Accuracy in points."""

    name: str  # e.g. "fp8_gen − bf16"
    effect: float  # mean of d_s (accuracy: points)
    ci: tuple[float, float]  # the decision's t interval
    ci_level: float
    bootstrap: tuple[float, float]  # percentile bootstrap interval at ci_level
    n: int
    sd: float
    p: float
    mde: float  # smallest |effect| detectable at `power` with n seeds
    seeds_needed: int | None  # seeds to detect the observed effect (claim 4: to show equivalence)
    power_line: str
    unit: str = ""
    decides: bool = True  # False: evidence beside the verdict (claim 3's "does not close it")
    finding: str = ""  # what a non-deciding comparison's interval says, e.g. "not closed"


@dataclass
class ClaimResult:
    number: int
    claim: str
    status: str
    comparisons: list[Comparison] = field(default_factory=list)
    statistic: str = ""  # what d_s is and which per-run summary it uses
    evidence: str = ""  # group summaries, e.g. "median mismatch: bf16 1.0012, ..."
    margin: float | None = None  # claim 4: the TOST margin in points
    step_order: list[dict] = field(default_factory=list)  # claims 1–2: `step_order(...)` per comparison
    metric: str = ""  # claims 3–4: the accuracy metric they were computed on
    deciding: bool = True  # False: claims 3–4 on the accuracy metric that does not decide

    def to_dict(self) -> dict:
        return jsonable(asdict(self))


def jsonable(x):
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else None
    return x.item() if isinstance(x, np.generic) else x


def fmt_value(x: float, unit: str, signed: bool = False) -> str:
    """Accuracy in points (`12.3 pts`), mismatch with 3 significant digits; NaN → n/a."""
    if x is None or not np.isfinite(x):
        return "n/a"
    spec = (".1f" if unit == ACC_UNIT else ".3g")
    body = format(x, ("+" if signed else "") + spec)
    return f"{body} {unit}".rstrip()


def power_line(d: np.ndarray, cfg: AnalysisConfig, unit: str) -> tuple[float, int | None, str]:
    """`(mde, seeds needed for the observed effect, text)` for a two-sided paired t test."""
    n = d.size
    sd = float(np.std(d, ddof=1)) if n >= 2 else float("nan")
    effect = float(np.mean(d)) if n else 0.0
    if n < 2:
        return float("nan"), None, f"{n} paired seed{'s' * (n != 1)}: at least 2 are needed for an interval"
    if sd == 0:
        return 0.0, None, f"with {n} seeds the differences have no spread: any nonzero gap is detected"
    mde = st.min_detectable(sd, n, cfg.alpha, cfg.power)
    needed = st.seeds_needed(lambda k: st.t_power(effect, sd, k, cfg.alpha), cfg.power) if effect else None
    head = f"with {n} seeds the smallest detectable gap is {fmt_value(mde, unit)} ({cfg.power:.0%} power)"
    tail = (f"about {needed} seeds would detect {fmt_value(abs(effect), unit)}" if needed
            else f"more than {st.MAX_SEEDS} seeds would be needed for {fmt_value(abs(effect), unit)}" if effect
            else "the observed gap is 0")
    return mde, needed, f"{head}; {tail}"


def tost_power_line(d: np.ndarray, cfg: AnalysisConfig) -> tuple[float, int | None, str]:
    """TOST's power line (accuracy in points): MDE for a gap, and the seeds to show equivalence at the
    observed gap (or at 0 when it exceeds the margin, then also the seeds to show it is beyond)."""
    mde, _, text = power_line(d, cfg, ACC_UNIT)
    n, m = d.size, cfg.equivalence_margin
    if n < 2 or not np.isfinite(mde) or mde == 0:
        return mde, None, text
    sd, effect = float(np.std(d, ddof=1)), float(np.mean(d))
    at = effect if abs(effect) < m else 0.0
    pw = st.tost_power(at, sd, n, m, cfg.alpha)
    needed = st.seeds_needed(lambda k: st.tost_power(at, sd, k, m, cfg.alpha), cfg.power)
    line = (f"with {n} seeds the smallest detectable gap is {fmt_value(mde, ACC_UNIT)}; TOST at ±{m:g} pts has "
            f"{pw:.0%} power if the true gap is {at:+.1f} pts; "
            + (f"about {needed} seeds would show equivalence" if needed else f"more than {st.MAX_SEEDS} seeds needed"))
    if abs(effect) >= m:
        beyond = st.seeds_needed(lambda k: st.t_power(abs(effect) - m, sd, k, cfg.alpha), cfg.power)
        if beyond:
            line += f"; about {beyond} seeds would show the observed {effect:+.1f} pts is beyond the margin"
    return mde, needed, line


def compare(name: str, d: np.ndarray, cfg: AnalysisConfig, unit: str, tost: bool = False) -> Comparison:
    """The numbers of one comparison; `tost` uses the (1 − 2α) interval and TOST's power line."""
    level = 1 - 2 * cfg.alpha if tost else 1 - cfg.alpha
    mean, lo, hi, sd = (float(v) for v in st.t_interval(d, level))
    boot = st.bootstrap_interval(d, level, cfg.bootstrap_resamples, cfg.seed)
    mde, needed, line = tost_power_line(d, cfg) if tost else power_line(d, cfg, unit)
    return Comparison(name, mean, (lo, hi), level, boot, int(d.size), sd, float(st.p_value(d)), mde, needed, line, unit)


def choose_is_variant(runs: Sequence[RunHistory] | Sequence[RunSummary], is_variant: str | None = None) -> str | None:
    def isv(r):
        return r.importance_sampling if isinstance(r, RunSummary) else r.get(TAG_IS)
    variants = sorted({isv(r) for r in runs} - {None, "none", "?"})
    if is_variant is not None:
        return is_variant
    return "token" if "token" in variants else (variants[0] if variants else None)


def ratio_text(ratio: float) -> str:
    """A mismatch ratio (>= 1) legible at every scale: 1.0119, or 1 + 3.2e-08 near the FP32 floor."""
    return f"{ratio:.4f}" if abs(ratio - 1) >= 1e-3 else f"1 + {ratio - 1:.2g}"


def _median_text(sums: Sequence[RunSummary], recipes: Sequence[str]) -> str:
    parts = []
    for rc in recipes:
        members = [s for s in select(sums, rc) if np.isfinite(s.mismatch_median)]
        if members:
            med = np.mean([s.mismatch_median for s in members])
            trim = np.mean([s.mismatch_trimmed for s in members])
            parts.append(f"{rc} {ratio_text(med)} (trimmed mean {ratio_text(trim)}, {len(members)} runs)")
        else:
            parts.append(f"{rc}: no runs")
    return "per-run median mismatch, mean over runs: " + "; ".join(parts)


def step_order(runs: Sequence[RunHistory], low: str, high: str, cfg: AnalysisConfig) -> dict | None:
    """Figure 1's "consistently lower" as a paired statistic: per seed the fraction of steps at which
    `low`'s mismatch < `high`'s (same seed and IS setting, step by step), its mean over seeds and the
    (1 − α) t interval over seeds (the seed is the replicate: steps within a run are correlated)."""
    frac = step_order_fractions(runs, low, high)
    if frac.size == 0:
        return None
    mean, lo, hi, _ = (float(v) for v in st.t_interval(frac, 1 - cfg.alpha))
    return {"low": low, "high": high, "fraction": mean, "ci": (max(lo, 0.0), min(hi, 1.0)), "n": int(frac.size)}


def _order_text(o: dict) -> str:
    ci = f" [{o['ci'][0]:.0%}, {o['ci'][1]:.0%}]" if np.isfinite(o["ci"][0]) else ""
    return f"{o['low']} below {o['high']} at {o['fraction']:.0%}{ci} of steps (per seed, paired by step)"


def _mismatch_claim(number: int, claim: str, runs, sums, base: str, others: Sequence[str], cfg) -> ClaimResult:
    ds = [paired(sums, base, rc, "mismatch_median")[0] for rc in others]
    comps = [compare(f"{rc} − {base}", d, cfg, MISMATCH_UNIT) for rc, d in zip(others, ds)]
    usable = bool(comps) and all(c.n >= 2 for c in comps)
    status = VERDICT[int(st.decide_positive(ds, cfg.alpha))] if usable else INCONCLUSIVE
    order = [o for o in (step_order(runs, base, rc, cfg) for rc in others) if o]
    orders = "; ".join(_order_text(o) for o in order)
    evidence = _median_text(sums, [base, *others]) + (f". {orders}" if orders else "")
    statistic = "per-seed paired difference of per-run median mismatch (> 0: " + base + " lower)"
    return ClaimResult(number, claim, status, comps, statistic, evidence, step_order=order)


def claim_lowest_mismatch(runs: Sequence[RunHistory], cfg: AnalysisConfig | None = None,
                          sums: Sequence[RunSummary] | None = None) -> ClaimResult:
    cfg = cfg or AnalysisConfig()
    sums = summarize_all(runs, cfg.trim) if sums is None else sums
    others = sorted({s.recipe for s in sums} - {"bf16", "?"}, key=recipe_rank)
    res = _mismatch_claim(1, "bf16 has the lowest mismatch", runs, sums, "bf16", others, cfg)
    if not select(sums, "bf16") or not others:
        res.status = INCONCLUSIVE
    return res


def claim_e2e_below_gen(runs: Sequence[RunHistory], cfg: AnalysisConfig | None = None,
                        sums: Sequence[RunSummary] | None = None) -> ClaimResult:
    cfg = cfg or AnalysisConfig()
    sums = summarize_all(runs, cfg.trim) if sums is None else sums
    return _mismatch_claim(2, "fp8_e2e mismatch < fp8_gen mismatch", runs, sums, "fp8_e2e", ["fp8_gen"], cfg)


def _accuracy(sums: Sequence[RunSummary], recipe: str, isv: str, attr: str) -> dict[str, float]:
    values = {s.seed: getattr(s, attr) for s in select(sums, recipe, isv)}
    return {seed: v for seed, v in values.items() if np.isfinite(v)}


def _missing_text(sums: Sequence[RunSummary], metric: str) -> str:
    """'val_accuracy_bf16_eval: missing (not logged by these runs). ' or ''."""
    return "" if accuracy_logged(sums, metric) else f"{metric}: missing (not logged by these runs). "


def _baseline_isv(sums: Sequence[RunSummary]) -> str | None:
    settings = {s.importance_sampling for s in select(sums, "bf16")}
    return "none" if "none" in settings else (sorted(settings)[0] if settings else None)


def gap_statistic(ref: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """d_s = sgn · (b_s − a_s), sgn = sign(mean_s(ref_s − (a_s + b_s)/2)); arrays [..., n] (claim 3).
    mean(d) > 0 ⟺ |mean(ref − b)| < |mean(ref − a)|: with IS the gap to the reference is smaller."""
    sgn = np.sign(np.mean(ref - (a + b) / 2, axis=-1, keepdims=True)) if ref.shape[-1] else 0.0
    return sgn * (b - a)


def _gap_finding(c: Comparison) -> str:
    """What the interval of the gap left with IS says (claim 3's second half)."""
    lo, hi = c.ci
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "no interval"
    return "not closed" if lo > 0 else "overshot" if hi < 0 else "closing not excluded"


def remaining_gap(ref: np.ndarray, a: np.ndarray, b: np.ndarray, name: str, cfg: AnalysisConfig) -> Comparison:
    """g_s = sgn₀ · (ref_s − b_s), sgn₀ = sign(mean_s(ref_s − a_s)): the gap left with IS, on the side
    the gap had without it (> 0: not closed). Arrays [n] in points; a non-deciding Comparison."""
    sgn = np.sign(np.mean(ref - a)) if ref.size else 0.0
    comp = compare(name, sgn * (ref - b), cfg, ACC_UNIT)
    comp.decides, comp.finding = False, _gap_finding(comp)
    return comp


def claim_is_narrows_gap(runs: Sequence[RunHistory], cfg: AnalysisConfig | None = None,
                         sums: Sequence[RunSummary] | None = None, metric: str | None = None) -> ClaimResult:
    """Claim 3 on `metric` (default `cfg.accuracy_metric`)."""
    cfg = cfg or AnalysisConfig()
    metric = metric or cfg.accuracy_metric
    sums = summarize_all(runs, cfg.trim) if sums is None else sums
    v, base = choose_is_variant(sums, cfg.is_variant), _baseline_isv(sums)
    claim = f"IS ({v or 'none found'}) narrows fp8_gen's accuracy gap to bf16"
    attr = ACCURACY_ATTR[metric]
    ref, a = _accuracy(sums, "bf16", base or "", attr), _accuracy(sums, "fp8_gen", "none", attr)
    b = _accuracy(sums, "fp8_gen", v or "", attr)
    seeds = sorted(set(ref) & set(a) & set(b))
    r_, a_, b_ = (np.array([x[s] for s in seeds]) * 100 for x in (ref, a, b))
    d = gap_statistic(r_, a_, b_)
    comp = compare(f"fp8_gen+{v} − fp8_gen+none, towards bf16", d, cfg, ACC_UNIT)
    left = remaining_gap(r_, a_, b_, f"gap left: bf16+{base} − fp8_gen+{v} (does not close it; not deciding)", cfg)
    status = VERDICT[int(st.decide_positive([d], cfg.alpha))] if d.size >= 2 and d.any() else INCONCLUSIVE
    gaps = (f"bf16 {r_.mean():.1f}%, fp8_gen no IS {a_.mean():.1f}%, IS {v} {b_.mean():.1f}%: gap without IS "
            f"{(r_ - a_).mean():+.1f} pts, with IS {(r_ - b_).mean():+.1f} pts over {len(seeds)} seeds. "
            f"Does not close it (not deciding): gap left {fmt_value(left.effect, ACC_UNIT, signed=True)}, "
            f"{left.ci_level:.0%} interval [{fmt_value(left.ci[0], ACC_UNIT, signed=True)}, "
            f"{fmt_value(left.ci[1], ACC_UNIT, signed=True)}]: {left.finding}"
            if seeds else "no seed has all three cells")
    statistic = (f"per-seed paired change of fp8_gen's final {metric} with IS, signed towards bf16 "
                 f"(> 0: gap narrowed)")
    return ClaimResult(3, claim, status, [comp, left], statistic, _missing_text(sums, metric) + gaps, metric=metric)


def claim_e2e_is_matches_bf16(runs: Sequence[RunHistory], cfg: AnalysisConfig | None = None,
                              sums: Sequence[RunSummary] | None = None, metric: str | None = None) -> ClaimResult:
    """Claim 4 on `metric` (default `cfg.accuracy_metric`)."""
    cfg = cfg or AnalysisConfig()
    metric = metric or cfg.accuracy_metric
    sums = summarize_all(runs, cfg.trim) if sums is None else sums
    v = choose_is_variant(sums, cfg.is_variant)
    settings = {s.importance_sampling for s in select(sums, "bf16")}
    ref_isv = v if v in settings else _baseline_isv(sums)
    claim = f"fp8_e2e + IS ({v or 'none found'}) matches bf16's final accuracy (TOST ±{cfg.equivalence_margin:g} pts)"
    d, seeds = (paired(sums, "bf16", "fp8_e2e", ACCURACY_ATTR[metric], isv=ref_isv, isv_b=v) if v and ref_isv
                else (np.zeros(0), []))
    d = d * 100
    comp = compare(f"fp8_e2e+{v} − bf16+{ref_isv}", d, cfg, ACC_UNIT, tost=True)
    status = VERDICT[int(st.decide_equivalence(d, cfg.equivalence_margin, cfg.alpha))] if d.size >= 2 else INCONCLUSIVE
    statistic = (f"per-seed paired difference of final {metric} (points); TOST at margin "
                 f"±{cfg.equivalence_margin:g} pts, "
                 f"{1 - 2 * cfg.alpha:.0%} interval")
    evidence = (_missing_text(sums, metric)
                + f"{len(seeds)} paired seeds; mean difference {fmt_value(comp.effect, ACC_UNIT, signed=True)}")
    return ClaimResult(4, claim, status, [comp], statistic, evidence, cfg.equivalence_margin, metric=metric)


def check_claims(data: SweepData | Sequence[RunHistory], cfg: AnalysisConfig | None = None) -> list[ClaimResult]:
    """The four deciding verdicts (claims 3–4 on `cfg.accuracy_metric`), on the distinct-kernel runs."""
    cfg = cfg or AnalysisConfig()
    runs = list(data.runs if isinstance(data, SweepData) else data)
    sums = summarize_all(runs, cfg.trim)  # once: the claims read the same per-run summaries
    return [claim(runs, cfg, sums) for claim in
            (claim_lowest_mismatch, claim_e2e_below_gen, claim_is_narrows_gap, claim_e2e_is_matches_bf16)]


def other_accuracy_claims(data: SweepData | Sequence[RunHistory], cfg: AnalysisConfig | None = None
                          ) -> list[ClaimResult]:
    """Claims 3–4 on the accuracy metric that does not decide (`deciding=False`); [] when no run logged
    it (runs from before val_accuracy_bf16_eval existed)."""
    cfg = cfg or AnalysisConfig()
    runs = list(data.runs if isinstance(data, SweepData) else data)
    sums, metric = summarize_all(runs, cfg.trim), cfg.other_accuracy_metric
    if not accuracy_logged(sums, metric):
        return []
    results = [claim_is_narrows_gap(runs, cfg, sums, metric), claim_e2e_is_matches_bf16(runs, cfg, sums, metric)]
    for r in results:
        r.deciding = False
    return results
