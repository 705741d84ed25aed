"""The engine study: Figure 1 per recipe · generation engine, with a real inference engine beside ours.

    python -m analysis.engines sweeps/fp8_vllm_cpu.yaml [--out DIR] [--tracking-uri URI] [--no-log]
    rep = make_engines_report(uri, experiment, sweep_name, out_dir, parent_run_id=..., config=cfg, cell_ids=...)
    result = analyze(runs, cfg)          # in memory: list[RunHistory] -> EnginesResult

The report stage of a sweep whose file says `analysis: {kind: engines}` runs this instead of the claims
(`analysis.report.make_report` hands over). The claims report groups runs by recipe × IS, so a bf16 run with
vLLM generation and a bf16 run with ours would be one group there; here the arm is the recipe and the engines
(`analysis.engine_arms`: "bf16 · native", "bf16 · vLLM", "fp8_gen · vLLM W8A16").

**Per run** (over its logged steps): `mismatch` = the median of token_mult_prob_error, `gen_kl` = the median
of gen_kl_error (both heavy-tailed: a few tokens many nats apart make per-step spikes; the median is robust to
them, as in claims 1–2). Matched-kernel runs (`analysis.kernel_match`) are left out. Two runs with the same arm and
seed make a ValueError naming the params they differ in (pairing by seed would be ambiguous).

**Ordering fractions.** For every pair of arms (A, B), oriented by `engine_arms.EXPECTED_ORDER` (fixed before
any run: A is the arm claims 1–2 expect lower), over the seeds both ran (same seed = same prompts and
sampling stream): the share of seeds whose A median is below B's, for each metric, with the mean paired
difference B − A and its (1 − α) t interval. A share is a count over n seeds, not a test: 3 of 3 is what a
fair coin gives one time in eight.

**Claims 1–2** (`analysis.claims`' rules on per-seed paired differences of the mismatch median, d = B − A):
- claim 1, real baseline: every FP8 arm against bf16 · vLLM (the real-kernel BF16 mismatch, issue 30). PASS
  iff every (1 − α) interval lies above 0, FAIL iff some (1 − α/k) interval lies below 0 (`stats.decide_positive`),
  else INCONCLUSIVE;
- claim 1, our engines: every native FP8 arm against bf16 · native (the study's own claim 1, these runs);
- claim 2, our engines: fp8_gen · native against fp8_e2e · native;
- claim 2, real engine: fp8_gen against fp8_e2e, both with vLLM generation of the same kind (weight-only or
  not, which the name says); NOT TESTED where no such pair ran, with the reason (vLLM's CPU build runs FP8
  only with AMX tiles, and then weight-only).
Fewer than 2 paired seeds: INCONCLUSIVE. gen_kl_error's comparisons are shown beside, never deciding.

Figure 1 (`fig1_engines`, PNG + SVG): token_mult_prob_error per step, one curve per arm (mean ± 95% t band
over seeds), colour by recipe (as in the study's Figure 1), line style by generation engine (native solid,
vLLM dashed, vLLM W8A16 dash-dot), on the study's log scale of ratio − 1 with the acceptable band 1.03–1.05.
`engines.md`: the per-arm table, the per-run medians, the ordering fractions and the claims. `engines.json`:
every number, with the run ids and the runs' engine tags per arm (fp8rl.vllm.version / device / fp8_kernel /
fp8_quantizes, fp8rl.fp8_gemm, fp8rl.bf16_compute, fp8rl.cpu_flags), and the provenance (sweep file and its
sha256, tracking URI, parent run, git commit, date).
"""
from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from analysis import stats as st  # noqa: E402
from analysis.aggregate import Curve, align, differing_params, mean_ci, seed_key  # noqa: E402
from analysis.claims import VERDICT, ClaimResult, compare, jsonable, ratio_text  # noqa: E402
from analysis.config import AnalysisConfig  # noqa: E402
from analysis.engine_arms import NATIVE, VLLM, EngineArm, arm_of, expected_pairs  # noqa: E402
from analysis.entry import fetch_runs, log_files, sweep_file_main
from analysis.fetch import RunHistory, SweepData  # noqa: E402
from analysis.figures import (  # noqa: E402
    ACCEPTABLE,
    _draw_floor,
    _finish,
    _log_excess_axis,
    _plot,
    axis_floor,
    ci_note,
    recipe_color,
    save,
)
from analysis.kernel_match import only_kernels  # noqa: E402
from analysis.links import ui_link  # noqa: E402
from analysis.provenance import provenance  # noqa: E402
from analysis.settling import (  # noqa: E402
    ACCURACY_METRICS,
    Settling,
    accuracy_start_end,
    reward_halves,
    run_settling,
)
from fp8rl_core.diagnostics.catalogue import M_GEN_KL  # noqa: E402
from fp8rl_core.tracking import M_MISMATCH, TAG_BF16_COMPUTE, TAG_CPU_FLAGS, TAG_FP8_GEMM, TAG_SEED  # noqa: E402
from fp8rl_core.tracking.contract import M_STEP_TIME  # noqa: E402

FIG1 = "fig1_engines"
NAN = float("nan")
MISMATCH, GEN_KL = "mismatch", "gen_kl"
METRICS = {MISMATCH: M_MISMATCH, GEN_KL: M_GEN_KL}  # per-run summary -> the per-step metric it is the median of
NOT_TESTED = "NOT TESTED"
ENGINE_STYLES = {NATIVE: "-", VLLM: "--"}
WEIGHT_ONLY_STYLE = "-."
VLLM_TAGS = ("fp8rl.vllm.version", "fp8rl.vllm.device", "fp8rl.vllm.fp8_kernel", "fp8rl.vllm.fp8_quantizes")
ENGINE_TAGS = (*VLLM_TAGS, TAG_FP8_GEMM, TAG_BF16_COMPUTE, TAG_CPU_FLAGS)


@dataclass(frozen=True)
class RunEngines:
    run_id: str
    run_name: str
    status: str
    seed: str
    arm: EngineArm
    values: dict[str, float]  # MISMATCH, GEN_KL: medians over the run's steps (NaN: not logged)
    steps: int  # steps of token_mult_prob_error logged
    tags: dict[str, str]  # the run's ENGINE_TAGS that it has
    settling: Settling | None = None  # has its mismatch median settled (analysis/settling.py)
    accuracy: dict[str, tuple[float, float]] = field(default_factory=dict)  # val metric -> (first, last)
    step_seconds: float = NAN  # median of step_time_s
    reward_halves: tuple[float, float] = (NAN, NAN)  # mean reward_mean over the first and the last half of steps


def _median(run: RunHistory, key: str) -> float:
    v = run.series(key)[1]
    v = v[np.isfinite(v)]
    return float(np.median(v)) if v.size else NAN


def summarize_run(run: RunHistory) -> RunEngines:
    return RunEngines(run.run_id, run.run_name, run.status, run.get(TAG_SEED) or "?", arm_of(run),
                      {k: _median(run, m) for k, m in METRICS.items()}, int(run.series(M_MISMATCH)[0].size),
                      {t: run.tags[t] for t in ENGINE_TAGS if t in run.tags}, run_settling(run),
                      accuracy_start_end(run), _median(run, M_STEP_TIME), reward_halves(run))


@dataclass
class Ordering:
    """One pair of arms on one metric: the share of paired seeds with A's median below B's."""

    low: str  # A's label (expected lower)
    high: str  # B's label
    metric: str  # MISMATCH or GEN_KL
    seeds: list[str]
    below: int  # seeds with A < B
    difference: float  # mean over seeds of B − A
    ci: tuple[float, float]  # its (1 − α) t interval (NaN with n < 2)

    @property
    def n(self) -> int:
        return len(self.seeds)

    @property
    def share(self) -> float:
        return self.below / self.n if self.n else NAN

    def to_dict(self) -> dict:
        return {"A": self.low, "B": self.high, "metric": self.metric, "n": self.n, "seeds": self.seeds,
                "A_below_B": self.below, "share": self.share, "mean_B_minus_A": self.difference, "ci": self.ci}


@dataclass
class EnginesResult:
    arms: list[EngineArm]  # EXPECTED_ORDER
    runs: list[RunEngines]
    orderings: list[Ordering]
    claims: list[ClaimResult]
    confidence: float
    by_arm: dict[str, dict[str, RunEngines]] = field(default_factory=dict)  # label -> seed -> run

    def arm(self, label: str) -> EngineArm | None:
        return next((a for a in self.arms if a.label == label), None)


def paired_differences(by_arm: dict[str, dict[str, RunEngines]], a: str, b: str, key: str
                       ) -> tuple[np.ndarray, list[str]]:
    """Per seed both arms ran with finite values: `b − a` of the per-run `key`, seeds in order."""
    ra, rb = by_arm.get(a, {}), by_arm.get(b, {})
    seeds = [s for s in sorted(set(ra) & set(rb), key=seed_key)
             if np.isfinite(ra[s].values[key]) and np.isfinite(rb[s].values[key])]
    return np.array([rb[s].values[key] - ra[s].values[key] for s in seeds], dtype=np.float64), seeds


def ordering(by_arm: dict[str, dict[str, RunEngines]], a: str, b: str, key: str, confidence: float) -> Ordering:
    d, seeds = paired_differences(by_arm, a, b, key)
    mean, lo, hi, _ = (float(x) for x in st.t_interval(d, confidence)) if d.size else (NAN, NAN, NAN, NAN)
    return Ordering(a, b, key, seeds, int((d > 0).sum()), mean, (lo, hi))


def _collision(label: str, seed: str, runs: Sequence[RunHistory]) -> ValueError:
    shown = differing_params(runs)
    return ValueError(f"arm {label!r}, seed {seed}: {len(runs)} runs ({', '.join(r.run_id for r in runs)}) with "
                      f"the same recipe and engines; they differ in {shown}. An engine sweep varies the recipe, the "
                      "engines and the seed only")


def _decide(number: int, claim: str, statistic: str, pairs: list[tuple[str, str]],
            by_arm: dict[str, dict[str, RunEngines]], cfg: AnalysisConfig, missing: str = "") -> ClaimResult:
    """`analysis.claims`' rule for claims 1–2 on the mismatch medians: every d = B − A above 0."""
    ds = [(f"{b} − {a}", paired_differences(by_arm, a, b, MISMATCH)[0]) for a, b in pairs]
    if not ds:
        return ClaimResult(number, claim, NOT_TESTED, statistic=statistic, evidence=missing)
    comparisons = [compare(name, d, cfg, "") for name, d in ds]
    if min(d.size for _, d in ds) < 2:
        status = VERDICT[st.NONE_CODE]
    else:
        status = VERDICT[int(st.decide_positive([d for _, d in ds], cfg.alpha))]
    return ClaimResult(number, claim, status, comparisons, statistic=statistic, evidence=_medians_text(
        by_arm, sorted({x for p in pairs for x in p}, key=lambda lab: [x for p in pairs for x in p].index(lab))))


def _medians_text(by_arm: dict[str, dict[str, RunEngines]], labels: Sequence[str]) -> str:
    parts = []
    for label in labels:
        v = [r.values[MISMATCH] for r in by_arm.get(label, {}).values() if np.isfinite(r.values[MISMATCH])]
        parts.append(f"{label} {ratio_text(float(np.mean(v)))} ({len(v)} runs)" if v else f"{label}: no runs")
    return "per-run median mismatch, mean over runs: " + "; ".join(parts)


def _find(arms: Sequence[EngineArm], recipe: str, generation: str, weight_only: bool | None = None) -> list[EngineArm]:
    return [a for a in arms if a.recipe == recipe and a.generation == generation and a.training == NATIVE
            and (weight_only is None or a.weight_only == weight_only)]


def claims(arms: Sequence[EngineArm], by_arm: dict[str, dict[str, RunEngines]], cfg: AnalysisConfig
           ) -> list[ClaimResult]:
    """Claims 1–2 against the real-kernel baseline and between our own engines (module docstring)."""
    out = []
    real_bf16 = _find(arms, "bf16", VLLM, False)
    fp8 = [a for a in arms if a.recipe != "bf16" and a.training == NATIVE]
    stat = "d = per-run median token_mult_prob_error of {} minus that of {}, paired by seed"
    if real_bf16 and fp8:
        base = real_bf16[0].label
        out.append(_decide(1, f"bf16 with real inference kernels ({base}) has a lower mismatch than every FP8 arm",
                           stat.format("the FP8 arm", base), [(base, a.label) for a in fp8], by_arm, cfg))
    else:
        out.append(ClaimResult(1, "bf16 with real inference kernels (bf16 · vLLM) has a lower mismatch than every "
                               "FP8 arm", NOT_TESTED, evidence="no bf16 · vLLM arm" if not real_bf16 else "no FP8 arm"))
    native_bf16 = _find(arms, "bf16", NATIVE)
    native_fp8 = [a for a in fp8 if a.generation == NATIVE]
    if native_bf16 and native_fp8:
        base = native_bf16[0].label
        out.append(_decide(1, f"bf16 between our own engines ({base}) has a lower mismatch than every native FP8 arm",
                           stat.format("the FP8 arm", base), [(base, a.label) for a in native_fp8], by_arm, cfg))
    for generation, weight_only in ((NATIVE, None), (VLLM, False), (VLLM, True)):
        e2e, gen = _find(arms, "fp8_e2e", generation, weight_only), _find(arms, "fp8_gen", generation, weight_only)
        if generation == NATIVE or e2e or gen:
            engine = "our own engines" if generation == NATIVE else "real inference kernels"
            name = f"fp8_e2e has a lower mismatch than fp8_gen, {engine}"
            if e2e and gen:
                low, high = e2e[0].label, gen[0].label
                out.append(_decide(2, f"{name} ({low} < {high})", stat.format(high, low), [(low, high)], by_arm, cfg))
            else:
                out.append(ClaimResult(2, name, NOT_TESTED, evidence=f"only {(e2e or gen)[0].label} ran"
                                       if (e2e or gen) else "no such arms"))
    if not any(a.real_engine and a.recipe != "bf16" for a in arms):
        out.append(ClaimResult(2, "fp8_e2e has a lower mismatch than fp8_gen, real inference kernels", NOT_TESTED,
                               evidence="no FP8 arm with vLLM generation ran: vLLM's CPU build serves FP8 linears only "
                                        "with AMX tiles (amx_tile), and then weight-only (W8A16, not the seed's "
                                        "recipe); on a CPU without AMX vLLM runs BF16 only"))
    return out


def analyze(runs: Sequence[RunHistory], cfg: AnalysisConfig | None = None) -> EnginesResult:
    """Arms, per-run medians, ordering fractions and claims 1–2 of the distinct-kernel `runs`."""
    cfg = cfg or AnalysisConfig()
    runs = only_kernels(list(runs))
    confidence = 1.0 - cfg.alpha
    summaries = [summarize_run(r) for r in runs]
    source: dict[tuple[str, str], list[RunHistory]] = defaultdict(list)
    by_arm: dict[str, dict[str, RunEngines]] = defaultdict(dict)
    for run, s in zip(runs, summaries):
        source[(s.arm.label, s.seed)].append(run)
        by_arm[s.arm.label][s.seed] = s
    for (label, seed), group in source.items():
        if len(group) > 1:
            raise _collision(label, seed, group)
    arms = sorted({s.arm for s in summaries}, key=lambda a: a.rank)
    orderings = [ordering(by_arm, a.label, b.label, key, confidence)
                 for a, b in expected_pairs(arms) for key in METRICS]
    return EnginesResult(arms, summaries, orderings, claims(arms, by_arm, cfg), confidence, dict(by_arm))


# --- output ----------------------------------------------------------------------------------------

def _num(x: float, digits: int = 4) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.{digits}f}"


def _sci(x: float) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.3g}"


def arm_rows(result: EnginesResult) -> list[dict]:
    """Per arm: runs, and the mean, median, min and max over runs of each per-run median."""
    rows = []
    for arm in result.arms:
        members = result.by_arm.get(arm.label, {})
        row: dict = {"arm": arm.label, "runs": len(members)}
        for key in METRICS:
            v = np.array([r.values[key] for r in members.values() if np.isfinite(r.values[key])])
            row[key] = {"mean": float(v.mean()) if v.size else NAN, "median": float(np.median(v)) if v.size else NAN,
                        "min": float(v.min()) if v.size else NAN, "max": float(v.max()) if v.size else NAN}
        rows.append(row)
    return rows


def arms_markdown(result: EnginesResult) -> str:
    lines = ["| arm | runs | token_mult_prob_error: mean of run medians | [min, max] | gen_kl_error: mean of run "
             "medians | [min, max] |", "|---|--:|--:|---|--:|---|"]
    for row in arm_rows(result):
        m, g = row[MISMATCH], row[GEN_KL]
        lines.append(f"| {row['arm']} | {row['runs']} | {_num(m['mean'])} | [{_num(m['min'])}, {_num(m['max'])}] | "
                     f"{_sci(g['mean'])} | [{_sci(g['min'])}, {_sci(g['max'])}] |")
    return "\n".join(lines) + "\n"


def runs_markdown(result: EnginesResult) -> str:
    """One row per seed, one column pair per arm: the per-run medians."""
    seeds = sorted({r.seed for r in result.runs}, key=seed_key)
    head = "| seed | " + " | ".join(f"{a.label}: mismatch | gen_kl" for a in result.arms) + " |"
    lines = [head, "|--:|" + "--:|--:|" * len(result.arms)]
    for seed in seeds:
        cells = []
        for a in result.arms:
            r = result.by_arm.get(a.label, {}).get(seed)
            cells += [_num(r.values[MISMATCH]), _sci(r.values[GEN_KL])] if r else ["–", "–"]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def orderings_markdown(result: EnginesResult) -> str:
    pct = f"{result.confidence:.0%}"
    lines = [f"| A (expected lower) | B | metric | seeds with A < B | mean B − A | {pct} t interval |",
             "|---|---|---|--:|--:|---|"]
    for o in result.orderings:
        ci = "n/a" if not np.isfinite(o.ci[0]) else f"[{o.ci[0]:+.3g}, {o.ci[1]:+.3g}]"
        metric = M_MISMATCH if o.metric == MISMATCH else M_GEN_KL
        lines.append(f"| {o.low} | {o.high} | {metric} | {o.below}/{o.n} | {o.difference:+.3g} | {ci} |")
    note = ("Per-run medians over steps, paired by seed. A share is a count, not a test: with n seeds, n/n happens "
            f"with probability 2^-n when the two arms are exchangeable (1/{2 ** max(result_n(result), 1)} here).")
    return "\n".join(lines) + "\n\n" + note + "\n"


def settling_markdown(result: EnginesResult) -> str:
    """Per run: the last-half median of token_mult_prob_error at S and S' steps, its 95% interval, settled?"""
    lines = ["| arm | seed | steps S / S' | last-half median at S | at S' | moved | 95% interval at S | settled |",
             "|---|--:|---|--:|--:|--:|---|---|"]
    for arm in result.arms:
        for seed, r in sorted(result.by_arm.get(arm.label, {}).items(), key=lambda kv: seed_key(kv[0])):
            st_ = r.settling
            if st_ is None:
                continue
            verdict = {True: "yes", False: "**no**", None: "n/a (< 4 steps)"}[st_.settled]
            lines.append(f"| {arm.label} | {seed} | {st_.steps} / {st_.earlier_steps} | {_num(st_.median)} | "
                         f"{_num(st_.earlier_median)} | {_num(st_.move)} | [{_num(st_.interval[0])}, "
                         f"{_num(st_.interval[1])}] | {verdict} |")
    n = sum(1 for r in result.runs if r.settling is not None and r.settling.settled)
    judged = sum(1 for r in result.runs if r.settling is not None and r.settling.settled is not None)
    return "\n".join(lines) + f"\n\n{n} of {judged} runs settled (analysis/settling.py states the rule).\n"


def accuracy_markdown(result: EnginesResult) -> str:
    """Per arm: mean over seeds of each validation metric at the first and the last validation step."""
    head = " | ".join(f"{m}: start | end" for m in ACCURACY_METRICS)
    lines = [f"| arm | runs | {head} |", "|---|--:|" + "--:|--:|" * len(ACCURACY_METRICS)]
    for arm in result.arms:
        members = list(result.by_arm.get(arm.label, {}).values())
        cells = []
        for m in ACCURACY_METRICS:
            for i in (0, 1):
                v = np.array([r.accuracy.get(m, (NAN, NAN))[i] for r in members], dtype=np.float64)
                v = v[np.isfinite(v)]
                cells.append(f"{v.mean():.3f}" if v.size else "–")
        lines.append(f"| {arm.label} | {len(members)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nMeans over seeds of pass@1 on the held-out prompts (val_accuracy: the arm's own " \
        "generation engine; val_accuracy_bf16_eval: the BF16 evaluation engine on the same weights).\n"


def result_n(result: EnginesResult) -> int:
    ns = [o.n for o in result.orderings]
    return max(ns) if ns else 0


def claim_lines(result: EnginesResult) -> list[str]:
    out = []
    for c in result.claims:
        out.append(f"Claim {c.number}: {c.claim}: **{c.status}**" + (f" ({c.evidence})" if c.status == NOT_TESTED
                                                                        else ""))
        for comp in c.comparisons:
            lo, hi = comp.ci
            ci = "n/a" if not np.isfinite(lo) else f"[{lo:+.3g}, {hi:+.3g}]"
            out.append(f"  - {comp.name}: {comp.effect:+.3g}, {comp.ci_level:.0%} t interval {ci}, n = {comp.n}; "
                       f"{comp.power_line}")
        if c.status != NOT_TESTED and c.evidence:
            out.append(f"  - {c.evidence}")
    return out


def engines_figure(result: EnginesResult, runs: Sequence[RunHistory], sweep_name: str | None = None):
    """Figure 1 per arm as a matplotlib Figure (not saved)."""
    by_id = {r.run_id: r for r in runs}
    cs: list[Curve] = []
    for arm in result.arms:
        members = [by_id[r.run_id] for r in result.by_arm[arm.label].values() if r.run_id in by_id]
        steps, values = align(members, M_MISMATCH)
        if steps.size:
            mean, half, n = mean_ci(values)
            cs.append(Curve(M_MISMATCH, {"arm": arm.label}, steps, values, mean, half, n, [r.run_id for r in members]))
    arms = [result.arm(c.group["arm"]) for c in cs]
    recipes = [a.recipe for a in arms]
    styles = [WEIGHT_ONLY_STYLE if a.weight_only else ENGINE_STYLES.get(a.generation, ":") for a in arms]
    floor, exact = axis_floor(cs)
    fig, ax = plt.subplots(figsize=(9.5, 5.2), layout="constrained")
    _plot(ax, cs, [a.label for a in arms], [recipe_color(r, recipes) for r in recipes], styles,
          [None] * len(cs), 1.0, 0.12, bounds=(1.0 + floor, np.inf))
    ax.axhspan(*ACCEPTABLE, color="#E69F00", alpha=0.14, linewidth=0, zorder=0,
               label="usual acceptable bound (1.03–1.05)")
    _log_excess_axis(ax, cs, floor, exact)
    if exact:
        _draw_floor(ax, floor, [])
    real = [o for o in result.orderings if o.metric == MISMATCH and (result.arm(o.low).real_engine
                                                                     or result.arm(o.high).real_engine)]
    order = "".join(f"\n  {o.low} < {o.high} in {o.below}/{o.n} seeds" for o in real)
    note = ci_note(cs) + ("\nper-run median token_mult_prob_error, paired by seed:" + order if order else "")
    _finish(ax, "Figure 1 · Generation vs training mismatch, per recipe · generation engine",
            f"sweep {sweep_name or '?'} · {len(result.runs)} runs · trainer: native in every arm", "RL step",
            "token_mult_prob_error  (log scale of ratio − 1)", note, "recipe · generation engine")
    return fig


def result_json(result: EnginesResult, cfg: AnalysisConfig, prov: dict) -> dict:
    tags: dict[str, dict[str, list[str]]] = {}
    for arm in result.arms:
        runs = result.by_arm.get(arm.label, {}).values()
        tags[arm.label] = {t: sorted({r.tags[t] for r in runs if t in r.tags}) for t in ENGINE_TAGS}
    return jsonable({
        "kind": "engines", "provenance": prov,
        "config": {"alpha": cfg.alpha, "confidence": result.confidence},
        "per_run": {MISMATCH: f"median over steps of {M_MISMATCH}", GEN_KL: f"median over steps of {M_GEN_KL}"},
        "arms": arm_rows(result),
        "engine_tags": tags,
        "orderings": [o.to_dict() for o in result.orderings],
        "claims": [c.to_dict() for c in result.claims],
        "runs": [{"run_id": r.run_id, "run_name": r.run_name, "status": r.status, "seed": r.seed, "arm": r.arm.label,
                  "steps": r.steps, **r.values, "tags": r.tags, "accuracy": r.accuracy,
                  "step_seconds": r.step_seconds, "reward_halves": r.reward_halves,
                  "settling": None if r.settling is None else {
                      "steps": r.settling.steps, "earlier_steps": r.settling.earlier_steps,
                      "median": r.settling.median, "earlier_median": r.settling.earlier_median,
                      "interval": r.settling.interval, "settled": r.settling.settled}}
                 for r in result.runs],
    })


def verdicts_text(result: EnginesResult) -> str:
    head = [f"Engine arms (per-run medians, paired by seed; {result.confidence:.0%} t intervals):"]
    for row in arm_rows(result):
        head.append(f"  {row['arm']}: {row['runs']} runs, token_mult_prob_error {_num(row[MISMATCH]['mean'])}, "
                    f"gen_kl_error {_sci(row[GEN_KL]['mean'])} (means of run medians)")
    head += [f"  {o.low} < {o.high} ({o.metric}): {o.below}/{o.n} seeds" for o in result.orderings]
    return "\n".join([*head, *(line.replace("**", "") for line in claim_lines(result))])


@dataclass
class EnginesReport:
    """What `make_engines_report` wrote; duck-typed like `analysis.report.ReportPaths` for `make_report`'s callers."""

    out_dir: Path
    report: Path
    figure: list[Path]  # PNG, SVG
    table_md: Path
    json: Path
    result: EnginesResult
    verdicts_text: str = ""
    verdicts: dict = field(default_factory=dict)
    ui_link: str = ""
    logged_to: str | None = None
    statuses: dict[str, int] = field(default_factory=dict)
    episodes: None = None  # the engine report flags no episodes (the claims and numerics reports do)

    def files(self) -> list[Path]:
        return [self.report, *self.figure, self.table_md, self.json]


def tables_markdown(result: EnginesResult) -> str:
    return "\n".join(["## Per arm", "", arms_markdown(result), "## Per run (medians over steps)", "",
                      runs_markdown(result), "## Ordering fractions", "", orderings_markdown(result),
                      "## Claims 1–2", "", *claim_lines(result), "",
                      "## Has the mismatch settled?", "", settling_markdown(result),
                      "## Validation at the start and the end", "", accuracy_markdown(result)])


def write_engines(result: EnginesResult, runs: Sequence[RunHistory], cfg: AnalysisConfig, out_dir: str | Path,
                  prov: dict, data: SweepData | None = None) -> EnginesReport:
    """Figure 1 per arm, engines.md, engines.json and report.md under `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweep = prov.get("sweep")
    figure = save(engines_figure(result, runs, sweep), out, FIG1)
    tables = tables_markdown(result)
    table_md = out / "engines.md"
    table_md.write_text("# Engine arms: mismatch per recipe · generation engine\n\n" + tables)
    js = result_json(result, cfg, prov)
    json_path = out / "engines.json"
    json_path.write_text(json.dumps(js, indent=2) + "\n")
    link = ui_link(data.uri, data.experiment_id, data.parent_run_id) if data else ""
    statuses = Counter(r.status for r in result.runs)
    head = [f"Tracking URI `{data.uri}`, parent run `{data.parent_run_id}`, {len(result.runs)} runs with distinct "
            f"kernels ({', '.join(f'{n} {s}' for s, n in sorted(statuses.items()))}) in {len(result.arms)} arms.",
            f"In the MLflow UI: {link}", ""] if data else []
    title = "Figure 1: token_mult_prob_error per recipe · generation engine"
    report = out / "report.md"
    report.write_text("\n".join([f"# Engine report: {sweep or '?'}", "", *head, f"## {title}", "",
                                 f"![{title}]({figure[0].name})", "", f"([SVG]({figure[1].name}))", "", tables,
                                 "Every number, with the run ids and engine tags per arm: "
                                 f"[engines.json]({json_path.name}).", ""]))
    return EnginesReport(out, report, figure, table_md, json_path, result, verdicts_text(result), js, link,
                         statuses=dict(statuses))


def make_engines_report(uri: str, experiment: str, sweep_name: str, out_dir: str | Path,
                        parent_run_id: str | None = None, log_artifacts: bool = True,
                        config: AnalysisConfig | None = None, cell_ids: Collection[str] | None = None,
                        sweep_file: str | Path | None = None) -> EnginesReport:
    """Fetch the sweep's child runs, analyze, write, and log the files under `report/` of the parent run."""
    cfg = config or AnalysisConfig()
    data = fetch_runs(uri, experiment, sweep_name, parent_run_id, cell_ids)
    result = analyze(data.runs, cfg)
    rep = write_engines(result, data.runs, cfg, out_dir, provenance(data, sweep_file, experiment), data)
    if log_artifacts and data.parent_run_id:
        log_files(uri, data.parent_run_id, rep.files())
        rep.logged_to = data.parent_run_id
    return rep


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m analysis.engines SWEEP_FILE`: the experiment, tracking URI, parent run, cells and `analysis:`
    block come from the sweep file, as `sweep report` reads them (`analysis.entry`)."""
    return sweep_file_main(argv, "analysis.engines", __doc__, make_engines_report)


if __name__ == "__main__":
    sys.exit(main())
