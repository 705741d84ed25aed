"""The numerics study: each low-precision knob of fp8_e2e against the default recipe, paired by seed.

    python -m analysis.numerics sweeps/fp8_numerics.yaml [--out DIR] [--tracking-uri URI] [--no-log]
    rep = make_numerics_report(uri, experiment, sweep_name, out_dir, parent_run_id=..., config=cfg, cell_ids=...)
    result = analyze(runs, cfg)          # in memory: list[RunHistory] -> NumericsResult (arms, effects)

The report stage of a sweep whose file says `analysis: {kind: numerics}` runs this instead of the
claims (`analysis.report.make_report` hands over).

**Arms.** The knobs are run-config keys, logged as MLflow params of every cell run under their dotted
names (`analysis.fetch` reads them in its one search): `KNOB_DEFAULTS` below. A run's arm is the set of
knobs whose (normalized) value differs from the default, labelled `fp8.format=mxfp8`; a run with every
knob at its default is the `default` arm. Normalization: a missing param is the default (runs logged
before the key existed); `fp8.scale_format` `auto`, or the format's own default scale format
(`fp8rl_core.fp8.formats`, e.g. fp32 for block128), is the default, and the legacy
`fp8.power_of_two_scales: true` reads as `pow2`; layer counts compare as integers. A cell that changes
two knobs at once is not an error: it is its own arm, labelled `fp8.format=mxfp8 + fp8.lm_head=fp8`
and marked "(2 knobs)" in the table, compared with the default like any other arm (its effect is
the two knobs together, not either one). Two runs with the same arm and seed (the cells differ in a
key that is not a knob, e.g. the recipe) make a ValueError naming the differing params: pairing by
seed would be ambiguous. Matched-kernel runs (`analysis.kernels`) are left out, as in the claims.

**Per run** (over its logged steps): `mismatch_median` = median of token_mult_prob_error (robust to
the spikes, as in the claims); `gen_kl` = mean of gen_kl_error (the catalogue's `M_GEN_KL`); the mean
of each tail fraction (`TAIL_FRACTIONS`); the final value (last validation step) of both accuracy
metrics, the deciding one (`analysis.accuracy_metric`) first.

**Per arm vs default, paired by seed** (same seed = same data and sampling stream): per-seed
differences d_i = arm − default, their mean, the (1 − α) paired t interval (`analysis.stats.t_interval`,
95% at the default α) and n. Verdict per metric: `higher` when the interval lies above 0, `lower`
when below, `no detectable difference` when it holds 0, `n/a (n < 2)` with fewer than two pairs.

**Mismatch on a log scale.** token_mult_prob_error sits near 1.00x and a knob moves its excess
(median − 1) by a factor (one format may have 5x the excess of another), so the deciding mismatch
effect is the paired difference of log10(median − 1): the log of the ratio of excess mismatch, shown
as a ratio (x2.0 = twice the excess) with its interval back-transformed. On a difference scale the
largest knob would squeeze every other to zero. A run whose median is <= 1 (no excess: the log is
undefined) leaves that metric's pair out. The plain difference of medians is tabled beside it.
Arms are ordered by the mean mismatch effect, largest increase first (no effect: last, by label).

Figure 3 (`fig3_numerics`, PNG + SVG): one panel per metric (mismatch excess ratio, gen_kl_error, tail
fraction > 0.1 nats, final accuracy in points), one row per arm in that order, its per-seed differences
as dots, the mean as a marker and its interval as a bar, a line at no effect. `numerics.md`: the table
(arm, metric, n, effect, interval, verdict). `numerics.json`: every number (per-run summaries, per-seed
differences, intervals) with its provenance (sweep file and its sha256, experiment, tracking URI,
parent run, run ids per arm and seed, git commit when available, date).

Instability episodes (`analysis.numerics_episodes`, band `analysis.episodes`, as in the claims report):
`analyze` flags every run (`result.episodes`); the report lists the flagged runs and the rates per knob
setting with their Clopper–Pearson intervals (report.md, numerics.md, numerics.json's `episodes`, the
terminal text), crosses the per-seed dots of Figure 3 whose pair holds a flagged run, says whether a
verdict changes without the flagged runs (the sensitivity line), and tags the child runs
`fp8rl.episode` / `fp8rl.episode_steps` when it logs to the parent run.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

from analysis.aggregate import final_value  # noqa: E402
from analysis.claims import jsonable  # noqa: E402
from analysis.config import ACCURACY_METRICS, AnalysisConfig  # noqa: E402
from analysis.episode_report import tag_runs  # noqa: E402
from analysis.fetch import RunHistory, SweepData  # noqa: E402
from analysis.figures import EPISODE_LABEL, EPISODE_MARKER, save  # noqa: E402
from analysis.kernels import only_kernels  # noqa: E402
from analysis.links import ui_link
from analysis.numerics_arms import (  # noqa: E402
    DEFAULT_ARM,
    HIGHER,
    KNOB_DEFAULTS,
    LOWER,
    NONE,
    TOO_FEW,
    arm_label,
    changed_knobs,
)
from analysis.stats import p_value, t_interval  # noqa: E402
from fp8rl_core.diagnostics.catalogue import M_GEN_KL  # noqa: E402
from fp8rl_core.tracking import M_MISMATCH, TAG_SEED, TAIL_FRACTIONS  # noqa: E402

if TYPE_CHECKING:
    from analysis.numerics_episodes import NumericsEpisodes

FIG3 = "fig3_numerics"
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


# --- arms ------------------------------------------------------------------------------------------

# --- per run ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunNumerics:
    run_id: str
    run_name: str
    status: str
    seed: str
    arm: str
    knobs: dict[str, str]  # the changed knobs ({} for the default arm)
    values: dict[str, float]  # Metric.key -> per-run summary (NaN: not logged)


def _finite(run: RunHistory, key: str) -> np.ndarray:
    v = run.series(key)[1]
    return v[np.isfinite(v)]


def summarize_run(run: RunHistory, cfg: AnalysisConfig | None = None) -> RunNumerics:
    cfg = cfg or AnalysisConfig()
    mm = _finite(run, M_MISMATCH)
    median = float(np.median(mm)) if mm.size else NAN
    values = {MISMATCH_LOG: float(np.log10(median - 1)) if median > 1 else NAN, "mismatch_median": median}
    for key in (M_GEN_KL, *TAIL_FRACTIONS):
        v = _finite(run, key)
        values[key] = float(v.mean()) if v.size else NAN
    for m in ACCURACY_METRICS:
        values[f"final_{m}"] = final_value(run, m)
    return RunNumerics(run.run_id, run.run_name, run.status, run.get(TAG_SEED) or "?", arm_label(run.params),
                       changed_knobs(run.params), values)


# --- per arm ---------------------------------------------------------------------------------------

@dataclass
class Effect:
    """One metric of one arm vs default: the per-seed differences and their paired t interval."""

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
    effects: dict[str, Effect] = field(default_factory=dict)  # Metric.key -> Effect (none for the default)

    @property
    def n_knobs(self) -> int:
        return len(self.knobs)


@dataclass
class NumericsResult:
    arms: list[Arm]  # the default first, then the others ordered by their mismatch effect
    runs: list[RunNumerics]
    metrics: list[Metric]
    confidence: float
    episodes: NumericsEpisodes | None = None  # every run's instability flags (analysis.numerics_episodes)

    @property
    def compared(self) -> list[Arm]:
        return [a for a in self.arms if a.label != DEFAULT_ARM]

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
    """arm − default per seed both have (finite values only), seeds in sorted order."""
    seeds, d = [], []
    for seed in sorted(set(arm_runs) & set(base), key=_seed_key):
        a, b = arm_runs[seed].values[metric], base[seed].values[metric]
        if np.isfinite(a) and np.isfinite(b):
            seeds.append(seed)
            d.append(a - b)
    arr = np.asarray(d, dtype=np.float64)
    mean, lo, hi, sd = (float(x) for x in t_interval(arr, confidence))
    p = float(p_value(arr)) if arr.size else NAN
    return Effect(arm, metric, seeds, d, mean, lo, hi, sd, p, verdict(lo, hi, arr.size))


def _seed_key(seed: str) -> tuple:
    return (0, int(seed), seed) if seed.lstrip("-").isdigit() else (1, 0, seed)


def _collision(label: str, seed: str, runs: Sequence[RunHistory]) -> ValueError:
    keys = sorted({k for r in runs for k in r.params})
    differ = [k for k in keys if len({r.params.get(k) for r in runs}) > 1]
    shown = ", ".join(differ[:6]) + (", ..." if len(differ) > 6 else "") or "none (the same config twice)"
    ids = ", ".join(r.run_id or r.run_name for r in runs)
    return ValueError(f"arm {label!r}, seed {seed}: {len(runs)} runs ({ids}) "
                      f"with the same numerics knobs; they differ in {shown}. A numerics sweep varies only the knobs "
                      f"({', '.join(KNOB_DEFAULTS)}) and the seed")


def _order_key(arm: Arm) -> tuple:
    e = arm.effects[MISMATCH_LOG].mean
    return (0, -e, arm.label) if np.isfinite(e) else (1, 0.0, arm.label)


def analyze(runs: Sequence[RunHistory], cfg: AnalysisConfig | None = None, episodes: bool = True) -> NumericsResult:
    """Arms, per-run summaries and paired effects of the distinct-kernel `runs` (module docstring), and
    (`episodes`) every run's instability flags with the sensitivity line, which re-runs this without
    them. ValueError when no run is the default arm or when two runs share an arm and a seed."""
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
    if DEFAULT_ARM not in by_arm:
        found = ", ".join(sorted(by_arm)) or "no runs"
        defaults = ", ".join(f"{k}={v}" for k, v in KNOB_DEFAULTS.items())
        raise ValueError(f"no default arm: no run has every numerics knob at its default ({defaults}); arms found: "
                         f"{found}. The numerics sweep needs a cell with the default recipe to pair every knob with")
    metrics = metrics_for(cfg)
    base = by_arm[DEFAULT_ARM]
    arms = []
    for label, members in by_arm.items():
        knobs = next(iter(members.values())).knobs
        ids = {seed: members[seed].run_id for seed in sorted(members, key=_seed_key)}
        arm = Arm(label, knobs, ids)
        if label != DEFAULT_ARM:
            arm.effects = {m.key: paired_effect(label, m.key, members, base, confidence) for m in metrics}
        arms.append(arm)
    default = next(a for a in arms if a.label == DEFAULT_ARM)
    ordered = sorted((a for a in arms if a is not default), key=_order_key)
    result = NumericsResult([default, *ordered], summaries, metrics, confidence)
    if episodes:
        from analysis.numerics_episodes import numerics_episodes

        # the sensitivity re-runs this analysis on the kept runs, handed in so that the two modules do not import
        # each other
        result.episodes = numerics_episodes(every, result, cfg,
                                            reanalyze=lambda kept: analyze(kept, cfg, episodes=False))
    return result


# --- output ----------------------------------------------------------------------------------------

def _fmt(x: float, m: Metric, signed: bool = True) -> str:
    if not np.isfinite(x):
        return "n/a"
    if m.log_ratio:
        return f"×{10 ** x:.3g}"
    v = x * m.scale
    spec = ("+" if signed else "") + (".2f" if m.unit else ".3g")
    return format(v, spec) + m.unit


def _arm_cell(arm: Arm) -> str:
    return f"{arm.label} ({arm.n_knobs} knobs)" if arm.n_knobs > 1 else arm.label


def markdown_table(result: NumericsResult) -> str:
    """One row per arm × metric: n, effect (arm − default), interval, verdict."""
    pct = f"{result.confidence:.0%}"
    lines = [f"| knob | metric | n | effect (knob − default) | {pct} CI | verdict |", "|---|---|--:|--:|---|---|"]
    for arm in result.compared:
        for m in result.metrics:
            e = arm.effects[m.key]
            ci = "n/a" if not np.isfinite(e.ci_low) else f"[{_fmt(e.ci_low, m)}, {_fmt(e.ci_high, m)}]"
            label = m.label.replace("|", "\\|")  # |Δ log p| inside a table cell
            lines.append(f"| {_arm_cell(arm)} | {label} | {e.n} | {_fmt(e.mean, m)} | {ci} | {e.verdict} |")
    default = next(a for a in result.arms if a.label == DEFAULT_ARM)
    note = (f"Paired by seed: per seed the knob's run minus the default run ({len(default.runs)} default runs). "
            f"Effect: the mean difference, with the {pct} paired t interval over n seeds; verdict higher / lower when "
            "the interval excludes 0, else no detectable difference. Mismatch excess ratio: the paired difference of "
            "log10(median token_mult_prob_error − 1), shown as the ratio of excess mismatch (×1 = no effect). "
            "Accuracy in points. Rows with (2 knobs): a cell that changed two knobs at once (their joint effect).")
    return "\n".join(lines) + "\n\n" + note + "\n"


def verdicts_text(result: NumericsResult, figure: Sequence[str]) -> str:
    """The terminal summary: one line per arm with its figure metrics."""
    by_key = {m.key: m for m in result.metrics}
    out = [f"Numerics (paired by seed vs default, {result.confidence:.0%} t intervals):"]
    for arm in result.compared:
        parts = []
        for key in figure:
            e, m = arm.effects[key], by_key[key]
            ci = "" if not np.isfinite(e.ci_low) else f" [{_fmt(e.ci_low, m)}, {_fmt(e.ci_high, m)}]"
            parts.append(f"{m.label} {_fmt(e.mean, m)}{ci} {e.verdict}")
        out.append(f"  {_arm_cell(arm)} (n={arm.effects[MISMATCH_LOG].n}): " + "; ".join(parts))
    return "\n".join(out)


def numerics_figure(result: NumericsResult, cfg: AnalysisConfig, sweep_name: str | None = None):
    """Figure 3 as a matplotlib Figure (not saved)."""
    by_key = {m.key: m for m in result.metrics}
    keys = figure_metrics(cfg)
    arms = result.compared
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 1.6 + 0.45 * max(len(arms), 1)),
                             sharey=True, layout="constrained")
    ys = np.arange(len(arms))[::-1]  # the first arm at the top
    eps = result.episodes
    for ax, key in zip(axes, keys):
        m = by_key[key]
        def tr(v, m=m):  # display units: a ratio for the log effect, points for accuracy
            return 10.0 ** np.asarray(v) if m.log_ratio else np.asarray(v) * m.scale

        for y, arm in zip(ys, arms):
            e = arm.effects[key]
            if e.n:
                ax.plot(tr(e.differences), np.full(e.n, y) + 0.18, "o", color="#999999", markersize=3.5,
                        linestyle="none", zorder=2)
                hit = np.isin(e.seeds, sorted(eps.pair_seeds(arm.label))) if eps else np.zeros(e.n, bool)
                if hit.any():  # over the seed's dot: its pair holds a run with an instability episode
                    ax.scatter(tr(e.differences)[hit], np.full(hit.sum(), y) + 0.18, label=EPISODE_LABEL,
                               **EPISODE_MARKER)
            if np.isfinite(e.ci_low):
                ax.plot(tr([e.ci_low, e.ci_high]), [y, y], color="#0072B2", linewidth=2.2, solid_capstyle="butt",
                        zorder=3)
            if np.isfinite(e.mean):
                ax.plot(tr(e.mean), y, "D", color="#D55E00", markersize=6, zorder=4)
        if m.log_ratio:
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"×{v:g}"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.axvline(1.0, color="#333333", linewidth=1.0, zorder=1)
            ax.set_xlabel("excess mismatch ratio (median − 1), knob / default")
        else:
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))  # plain labels: no offset text
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.3g}"))
            ax.axvline(0.0, color="#333333", linewidth=1.0, zorder=1)
            ax.set_xlabel(f"Δ {m.label}" + (" (points)" if m.unit else "") + ", knob − default")
        ax.set_title(m.label, loc="left", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3, linewidth=0.6)
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_ylim(-0.7, len(arms) - 0.3)
    axes[0].set_yticks(ys, [_arm_cell(a) + (eps.tick(a.label) if eps else "") for a in arms])
    note = eps.figure_note() if eps else ""
    pct = f"{result.confidence:.0%}"
    fig.suptitle(f"Figure 3 · Numerics knobs of fp8_e2e vs the default recipe, paired by seed "
                 f"(sweep {sweep_name or '?'}, n = {result.seeds_range()} seeds per knob)\n"
                 f"diamond: mean difference (knob − default); bar: {pct} paired t interval; dots: seeds; "
                 "knobs ordered by their effect on the mismatch" + (f"\n{note}" if note else ""),
                 x=0.01, ha="left", fontsize=11)
    if not arms:
        axes[0].text(0.5, 0.5, "no knob arms yet", transform=axes[0].transAxes, ha="center", color="#777777")
    return fig


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def provenance(data: SweepData | None, sweep_file: str | Path | None, experiment: str | None) -> dict:
    prov: dict = {"sweep_file": str(sweep_file) if sweep_file else None, "sweep_file_sha256": None,
                  "experiment": experiment, "sweep": data.sweep_name if data else None,
                  "tracking_uri": data.uri if data else None, "parent_run_id": data.parent_run_id if data else None,
                  "stale_runs_left_out": data.stale_runs if data else 0,
                  "git_commit": _git_commit(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    if sweep_file and Path(sweep_file).is_file():
        prov["sweep_file_sha256"] = hashlib.sha256(Path(sweep_file).read_bytes()).hexdigest()
    return prov


def result_json(result: NumericsResult, cfg: AnalysisConfig, prov: dict) -> dict:
    """Every number of the report (raw units: accuracy as a fraction, mismatch effect in log10) and where
    it came from."""
    return jsonable({
        "kind": "numerics", "provenance": prov,
        "config": {"alpha": cfg.alpha, "confidence": result.confidence, "accuracy_metric": cfg.accuracy_metric},
        "knob_defaults": KNOB_DEFAULTS,
        "metrics": [{"key": m.key, "label": m.label, "definition": m.definition,
                     "display": "ratio 10^effect" if m.log_ratio else f"x{m.scale:g}{m.unit}"} for m in result.metrics],
        "order": [a.label for a in result.compared],
        "arms": [{"arm": a.label, "knobs": a.knobs, "n_knobs": a.n_knobs, "run_ids": a.runs,
                  "effects": {k: e.to_dict() | ({"ratio": 10 ** e.mean, "ratio_ci": [10 ** e.ci_low, 10 ** e.ci_high]}
                                                if k == MISMATCH_LOG else {}) for k, e in a.effects.items()}}
                 for a in result.arms],
        "runs": [{"run_id": r.run_id, "run_name": r.run_name, "status": r.status, "seed": r.seed, "arm": r.arm,
                  **r.values} for r in result.runs],
        **({"episodes": result.episodes.to_dict()} if result.episodes else {}),
    })


@dataclass
class NumericsReport:
    """What `make_numerics_report` wrote; duck-typed like `analysis.report.ReportPaths` for the callers of
    `make_report` (`.report`, `.files()`, `.verdicts_text`, `.verdicts`, `.ui_link`, `.logged_to`)."""

    out_dir: Path
    report: Path
    figure: list[Path]  # PNG, SVG
    table_md: Path
    json: Path
    result: NumericsResult
    verdicts_text: str = ""
    verdicts: dict = field(default_factory=dict)
    ui_link: str = ""
    logged_to: str | None = None
    statuses: dict[str, int] = field(default_factory=dict)

    def files(self) -> list[Path]:
        return [self.report, *self.figure, self.table_md, self.json]

    @property
    def episodes(self) -> NumericsEpisodes | None:
        """The flagged runs, rates per knob setting and sensitivity (as `ReportPaths.episodes`)."""
        return self.result.episodes


def _runs_lines(data: SweepData, result: NumericsResult) -> list[str]:
    statuses = Counter(r.status for r in data.runs)
    state = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())) or "no runs"
    lines = [f"Tracking URI `{data.uri}`, parent run `{data.parent_run_id}`, {len(data.runs)} child runs ({state}); "
             f"{len(result.runs)} with distinct kernels in {len(result.arms)} arms (the default and "
             f"{len(result.compared)} knob settings)."]
    left = len(data.runs) - len(result.runs)
    if left:
        lines.append(f"{left} matched-kernel run{'s' * (left != 1)} (the zero-mismatch floor) left out.")
    if data.stale_runs:
        lines.append(f"{data.stale_runs} child run{'s' * (data.stale_runs != 1)} of an earlier version of the sweep "
                     "file left out.")
    return lines


def write_numerics(result: NumericsResult, cfg: AnalysisConfig, out_dir: str | Path, prov: dict,
                   data: SweepData | None = None) -> NumericsReport:
    """Figure 3, numerics.md, numerics.json and report.md under `out_dir`."""

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sweep = prov.get("sweep")
    figure = save(numerics_figure(result, cfg, sweep), out, FIG3)
    table = markdown_table(result)
    episodes = ["## Instability episodes", "", result.episodes.markdown()] if result.episodes else []
    table_md = out / "numerics.md"
    table_md.write_text("\n".join(["# Numerics: each knob vs the default recipe", "", table, *episodes]))
    js = result_json(result, cfg, prov)
    json_path = out / "numerics.json"
    json_path.write_text(json.dumps(js, indent=2) + "\n")
    text = verdicts_text(result, figure_metrics(cfg)) + (f"\n\n{result.episodes.text()}" if result.episodes else "")
    link = ui_link(data.uri, data.experiment_id, data.parent_run_id) if data else ""
    head = [*_runs_lines(data, result), f"In the MLflow UI: {link}", ""] if data else []
    title = "Figure 3: numerics knobs vs the default recipe"
    report = out / "report.md"
    report.write_text("\n".join([f"# Numerics report: {sweep or '?'}", "", *head, f"## {title}", "",
                                 f"![{title}]({figure[0].name})", "", f"([SVG]({figure[1].name}))", "",
                                 "## Paired effects", "", table,
                                 f"Every number, with the run ids per knob and seed: [numerics.json]({json_path.name})"
                                 ".",
                                 "", *episodes]))
    return NumericsReport(out, report, figure, table_md, json_path, result, text, js, link,
                          statuses=dict(Counter(r.status for r in result.runs)))


def make_numerics_report(uri: str, experiment: str, sweep_name: str, out_dir: str | Path,
                         parent_run_id: str | None = None, log_artifacts: bool = True,
                         config: AnalysisConfig | None = None, cell_ids: Collection[str] | None = None,
                         sweep_file: str | Path | None = None) -> NumericsReport:
    """Fetch the sweep's child runs (one search, histories in bulk), analyze, write, and log the files
    under `report/` of the parent run (as `make_report` does)."""

    from analysis.entry import fetch_runs, log_files

    cfg = config or AnalysisConfig()
    data = fetch_runs(uri, experiment, sweep_name, parent_run_id, cell_ids)
    result = analyze(data.runs, cfg)
    rep = write_numerics(result, cfg, out_dir, provenance(data, sweep_file, experiment), data)
    if log_artifacts and data.parent_run_id:
        client = log_files(uri, data.parent_run_id, rep.files())
        tag_runs(client, result.episodes.runs if result.episodes else [])  # as the claims report tags them
        rep.logged_to = data.parent_run_id
    return rep


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m analysis.numerics SWEEP_FILE`: the experiment, tracking URI, parent run, cells and `analysis:`
    block come from the sweep file, as `sweep report` reads them (`analysis.entry`)."""
    from analysis.entry import sweep_file_main

    return sweep_file_main(argv, "analysis.numerics", __doc__, make_numerics_report)


if __name__ == "__main__":
    sys.exit(main())
