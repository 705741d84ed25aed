"""The study's two figures (matplotlib, Agg backend), each saved as PNG and SVG.

- Figure 1 `fig1_token_mult_prob_error`: mismatch vs RL step, one curve per recipe (runs of a recipe
  pooled over its IS settings: IS changes the update, not the two engines' numerics), mean ± 95% CI
  band, the usual "acceptable" region 1.03–1.05 shaded, on a log scale of (ratio − 1) (rare tokens on
  which the engines disagree by many nats make heavy-tailed spikes; see `_log_excess_axis`). Its
  caption's second line is the paired per-step statistic behind "consistently lower": per seed, the
  fraction of steps at which one recipe's mismatch is below the other's (same seed and IS setting),
  its mean over seeds and t interval (`order_note`, `analysis.claims.step_order`). Matched-kernel runs
  (`analysis.kernel_match`: the trainer replays the generation engine, the zero-mismatch floor) are their
  own curves, dashed in the recipe's colour ("bf16, matched kernels"), their dashes shifted per recipe
  so that curves which coincide (bf16 and fp8_e2e both at 1 exactly) show both colours. A value of
  exactly 1 has no place on a log axis of ratio − 1: when a curve reaches it the axis gets a floor one
  decade below the smallest positive value, drawn as a dotted line, ticked "= 1 exactly" and
  annotated with the recipes that sit on it at every step (`axis_floor`).
- Figure 2 `fig2_val_accuracy`: validation accuracy (%) vs RL step, one curve per recipe × IS, of the
  deciding accuracy metric (`analysis.accuracy_metric`). Distinct-kernel runs only.
- Both: black crosses on a curve mark the steps at which one of its runs with an instability episode
  (module `analysis.episodes`; the sweep file's band `analysis.episodes`, on by default) was flagged:
  Figure 1 its mismatch steps above the band, Figure 2 its validation steps with an accuracy drop or
  inside its mismatch episode (`episodes.group_marks`); one legend entry, EPISODE_LABEL, and a caption
  line. A curve is a mean over runs, so a cross sits on the arm's mean at that step, not on the
  flagged run's own value.
Colors are fixed per recipe (Okabe–Ito, colour-blind safe: bf16 blue, fp8_gen vermillion, fp8_e2e
green) and line styles per IS variant (none solid, token dashed, tis dash-dot, icepop dotted), so a
curve looks the same in both figures. Legends sit outside the axes; a note under each figure says
what the band is ("mean ± 95% CI (Student t over N seeds)"); steps with one seed have no band.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display here or on cluster nodes
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

from analysis.aggregate import Curve, curves  # noqa: E402
from analysis.claims import step_order  # noqa: E402
from analysis.config import ACCURACY_LABELS, AnalysisConfig, EpisodeBand  # noqa: E402
from analysis.episodes import group_marks  # noqa: E402
from analysis.fetch import SweepData  # noqa: E402
from analysis.kernel_match import MATCHED, only_kernels  # noqa: E402
from fp8rl_core.tracking import M_MISMATCH, M_VAL_ACC, M_VAL_ACC_BF16_EVAL, TAG_IS, TAG_RECIPE, TAG_SEED  # noqa: E402

RECIPE_COLORS = {"bf16": "#0072B2", "fp8_gen": "#D55E00", "fp8_e2e": "#009E73"}
EXTRA_COLORS = ("#CC79A7", "#E69F00", "#56B4E9", "#000000", "#999999")
IS_STYLES = {"none": "-", "token": "--", "tis": "-.", "icepop": ":", "sequence": (0, (6, 2, 1, 2, 1, 2))}
EXTRA_STYLES = ((0, (8, 3)), (0, (1, 1)), (0, (4, 1, 1, 1)))
IS_MARKERS = {"none": "o", "token": "s", "tis": "^", "icepop": "D", "sequence": "v"}
ACCEPTABLE = (1.03, 1.05)
EXCESS_FLOOR = 1e-9  # Figure 1's log axis shows ratio - 1 down to this (an FP32 baseline sits near 1e-7)
MATCHED_DASH = (4.0, 8.0)  # matched-kernel curves: 4 on, 8 off; recipe i starts 4·i later (interleaved)
MATCHED_LEGEND = (4.0, 3.0)  # their legend samples: the same dashes, unshifted and denser
EXACT_LABEL = "= 1 exactly"  # the floor's tick label
FIG1, FIG2 = "fig1_token_mult_prob_error", "fig2_val_accuracy"
EPISODE_LABEL = "instability episode (analysis.episodes)"
# black with a white rim: visible on every recipe colour and on the CI bands, drawn above the curves
EPISODE_MARKER = dict(marker="X", s=42, color="#000000", edgecolors="white", linewidths=0.6, zorder=4)


def recipe_color(recipe: str, seen: Sequence[str] = ()) -> str:
    if recipe in RECIPE_COLORS:
        return RECIPE_COLORS[recipe]
    extras = sorted(r for r in set(seen) | {recipe} if r not in RECIPE_COLORS)
    return EXTRA_COLORS[extras.index(recipe) % len(EXTRA_COLORS)]


def is_style(variant: str, seen: Sequence[str] = ()):
    if variant in IS_STYLES:
        return IS_STYLES[variant]
    extras = sorted(v for v in set(seen) | {variant} if v not in IS_STYLES)
    return EXTRA_STYLES[extras.index(variant) % len(EXTRA_STYLES)]


def is_label(variant: str) -> str:
    return "no IS" if variant == "none" else f"IS {variant}"


def ci_note(cs: Sequence[Curve], pooled: str = "") -> str:
    """'mean ± 95% CI (Student t over 3 seeds)'; n as a range when groups differ. With `pooled` (a
    text saying what one curve pools, e.g. seeds × IS settings) n counts runs instead of seeds."""
    counts = sorted({int(c.n.max()) for c in cs if c.n.size})
    n = "?" if not counts else str(counts[0]) if len(counts) == 1 else f"{counts[0]}–{counts[-1]}"
    what = "run" if pooled else "seed"
    text = f"mean ± 95% CI (Student t over {n} {what}{'' if n == '1' else 's'}{'; ' + pooled if pooled else ''})"
    return text + ("; no band where fewer than 2" if counts and counts[0] < 2 else "")


def _plot(ax, cs: Sequence[Curve], labels: Sequence[str], colors, styles, markers, scale: float,
          band_alpha: float, bounds: tuple[float, float] | None = None) -> None:
    """bounds: the metric's range (an accuracy lies in [0, 100] %; Figure 1: from its axis floor): curves
    and CI bands are clipped to it (Figure 1 draws a ratio of exactly 1 on its floor line)."""
    for c, label, color, style, marker in zip(cs, labels, colors, styles, markers):
        mean = c.mean * scale if bounds is None else np.clip(c.mean * scale, *bounds)
        ax.plot(c.steps, mean, color=color, linestyle=style, linewidth=2.0, label=label, marker=marker,
                markersize=4.5, markerfacecolor="white" if marker not in (None, "o") else color)
        if np.isfinite(c.half).any():  # NaN half-widths (n < 2) leave gaps in the band
            lo, hi = c.lo * scale, c.hi * scale
            if bounds is not None:
                lo, hi = np.clip(lo, *bounds), np.clip(hi, *bounds)
            ax.fill_between(c.steps, lo, hi, color=color, alpha=band_alpha, linewidth=0)


def _mark_episodes(ax, cs: Sequence[Curve], marks: dict[tuple[str, ...], np.ndarray], scale: float = 1.0,
                   bounds: tuple[float, float] | None = None) -> int:
    """A cross on each curve's mean at its group's marked steps (`marks`: `episodes.group_marks` with the
    curves' grouping keys); the first collection carries EPISODE_LABEL (one legend entry). Returns the
    number of crosses drawn."""
    drawn = 0
    for c in cs:
        steps = marks.get(tuple(c.group.values()))
        if steps is None:
            continue
        idx = np.flatnonzero(np.isin(c.steps, steps) & np.isfinite(c.mean))
        if idx.size == 0:
            continue
        y = c.mean[idx] * scale if bounds is None else np.clip(c.mean[idx] * scale, *bounds)
        ax.scatter(c.steps[idx], y, label=EPISODE_LABEL if drawn == 0 else f"_{EPISODE_LABEL}", **EPISODE_MARKER)
        drawn += idx.size
    return drawn


def _finish(ax, title: str, subtitle: str, xlabel: str, ylabel: str, note: str, legend_title: str) -> None:
    ax.set_title(f"{title}\n{subtitle}", loc="left", fontsize=12)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3, linewidth=0.6)
    ax.spines[["top", "right"]].set_visible(False)
    if not ax.get_lines():  # e.g. a report early in a sweep, before the first validation step
        ax.text(0.5, 0.5, "no values logged yet", transform=ax.transAxes, ha="center", va="center", color="#777777")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False, fontsize=9, title=legend_title,
                  title_fontsize=9, alignment="left")
    # a caption under the x label (bbox_inches="tight" keeps it in the saved file)
    ax.annotate(note, xy=(0, 0), xycoords="axes fraction", xytext=(0, -38), textcoords="offset points",
                va="top", ha="left", fontsize=8.5, color="#444444")


def save(fig, out_dir: str | Path, stem: str) -> list[Path]:
    """`stem.png` (150 dpi) and `stem.svg`; the figure is closed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.png", out / f"{stem}.svg"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight", metadata={"Software": None})
    fig.savefig(paths[1], bbox_inches="tight", metadata={"Date": None})  # no timestamp: stable files
    plt.close(fig)
    return paths


def matched_style(i: int) -> tuple:
    """The dash pattern of the i-th matched-kernel curve: same period, shifted by 4 points per recipe."""
    return (MATCHED_DASH[0] * (i % 3), MATCHED_DASH)


def _finite(cs: Sequence[Curve], attr: str) -> np.ndarray:
    parts = [getattr(c, attr)[np.isfinite(getattr(c, attr))] for c in cs]
    return np.concatenate(parts) if parts else np.zeros(0)


def axis_floor(cs: Sequence[Curve]) -> tuple[float, bool]:
    """`(floor, exact)`: the smallest ratio − 1 Figure 1's log axis shows, and whether a curve's mean
    reaches 1 exactly somewhere. Exact: one decade below the decade of the smallest positive value
    (m in [10 F, 100 F): an empty decade separates the floor from every measured value), where
    values of exactly 1 are drawn. Otherwise EXCESS_FLOOR, below which nothing is drawn."""
    if not (_finite(cs, "mean") <= 1.0).any():
        return EXCESS_FLOOR, False
    values = np.concatenate([_finite(cs, "mean"), _finite(cs, "hi"), np.array(ACCEPTABLE)]) - 1.0
    smallest = values[values > 0].min()  # ACCEPTABLE makes it exist
    return float(10.0 ** (np.floor(np.log10(smallest)) - 1)), True


def _log_excess_axis(ax, cs: Sequence[Curve], floor: float = EXCESS_FLOOR, exact: bool = False) -> None:
    """y on a log scale of (ratio - 1), labelled in ratio units (1 + 1e-7, 1.001, 1.01, 1.1, 2, 11, ...).

    Why: the metric is a mean of exp|dlogp|, so one token the engines disagree on by 10 nats lifts
    a step to ~100 while typical steps sit at 1.001-1.02; on a linear axis the spikes flatten every
    curve into one line (and a symmetric CI band dips below 1, which the ratio never does).
    `exact`: the axis ends at `floor`, ticked EXACT_LABEL (see `axis_floor`)."""
    values = np.concatenate([_finite(cs, "mean"), _finite(cs, "hi"), np.array(ACCEPTABLE)])
    excess = np.clip(values - 1.0, floor, None)
    clip = floor / 10 if exact else floor  # exact: room below the floor line, so that no spine hides it
    ax.set_yscale("function", functions=(lambda y: np.log10(np.clip(y - 1.0, clip, None)),
                                         lambda e: 1.0 + 10.0 ** e))
    bottom = floor / 10 ** 0.4 if exact else excess.min() / 2
    ax.set_ylim(1.0 + bottom, 1.0 + excess.max() * 2)
    powers = [k for k in range(-12, 5) if 10.0 ** k > floor * 1.5]
    ticks = [1.0 + 10.0 ** k for k in powers]
    labels = [f"{t:.6g}" if k >= -5 else f"1 + 1e{k}" for k, t in zip(powers, ticks)]  # .6g would print "1"
    if exact:
        ticks, labels = [1.0 + floor, *ticks], [EXACT_LABEL, *labels]
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FixedFormatter(labels))
    ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def _draw_floor(ax, floor: float, ms: Sequence[Curve]) -> None:
    """The dotted floor line, a break mark on the y axis between it and the next decade (the distance
    to the floor means nothing), and what sits on it: 'ratio = 1 exactly at every step: bf16, fp8_e2e
    (matched kernels)' when whole curves do, else 'ratio = 1 exactly (no mismatch)'."""
    ax.axhline(1.0 + floor, color="#555555", linewidth=0.9, linestyle=":", zorder=0.5)
    for dy in (0.35, 0.55):  # two slanted ticks across the spine, half a decade above the floor
        ax.plot([0], [1.0 + floor * 10 ** dy], transform=ax.get_yaxis_transform(), clip_on=False, color="#333333",
                marker=[(-1.0, -0.4), (1.0, 0.4)], markersize=9, markeredgewidth=1.1, linestyle="none",
                label="_axis break")
    flat = [c.group.get(TAG_RECIPE, "?") for c in ms if c.mean.size and (c.mean == 1.0).all()]
    text = (f"ratio {EXACT_LABEL} at every step: {', '.join(flat)} (matched kernels)" if flat
            else f"ratio {EXACT_LABEL} (no mismatch)")
    ax.text(0.99, 1.0 + floor * 10 ** 0.15, text, transform=ax.get_yaxis_transform(), ha="right", va="bottom",
            fontsize=8.5, color="#333333")


ORDER_PAIRS = (("bf16", "fp8_gen"), ("bf16", "fp8_e2e"), ("fp8_e2e", "fp8_gen"))  # (expected lower, higher)


def order_note(data: SweepData, cfg: AnalysisConfig | None = None) -> str:
    """'paired per step (...), fraction of steps (mean over 5 seeds, 95% t interval):\nbf16 < fp8_gen at 99%
    [98%, 100%] · ...' for the study's pairs present in `data`; '' when none is."""
    cfg = cfg or AnalysisConfig()
    parts, ns = [], set()
    for low, high in ORDER_PAIRS:
        o = step_order(data.runs, low, high, cfg)
        if o is None:
            continue
        ci = f" [{o['ci'][0]:.0%}, {o['ci'][1]:.0%}]" if np.isfinite(o["ci"][0]) else ""
        parts.append(f"{low} < {high} at {o['fraction']:.0%}{ci}")
        ns.add(o["n"])
    if not parts:
        return ""
    n = "/".join(str(k) for k in sorted(ns))
    return (f"paired per step (same seed and IS setting), fraction of steps (mean over {n} seeds, "
            f"{1 - cfg.alpha:.0%} t interval):\n" + " · ".join(parts))


def mismatch_figure(data: SweepData, by: Sequence[str] = (TAG_RECIPE,), cfg: AnalysisConfig | None = None):
    """Figure 1 as a matplotlib Figure (not saved): one curve per recipe (distinct kernels), one dashed
    curve per recipe with matched-kernel runs; the caption adds `order_note`."""
    distinct, matched = only_kernels(data), only_kernels(data, MATCHED)
    cs, ms = curves(distinct, M_MISMATCH, by=by), curves(matched, M_MISMATCH, by=by)
    recipes = [c.group.get(TAG_RECIPE, "?") for c in cs]
    m_recipes = [c.group.get(TAG_RECIPE, "?") for c in ms]
    seen = recipes + m_recipes
    floor, exact = axis_floor([*cs, *ms])
    bounds = (1.0 + floor, np.inf)  # the ratio is >= 1 by definition; bands end at the axis floor
    fig, ax = plt.subplots(figsize=(9.5, 5.2), layout="constrained")
    _plot(ax, cs, [c.label for c in cs], [recipe_color(r, seen) for r in recipes], ["-"] * len(cs),
          [None] * len(cs), 1.0, 0.15, bounds=bounds)
    _plot(ax, ms, [f"{r}, matched kernels" for r in m_recipes], [recipe_color(r, seen) for r in m_recipes],
          [matched_style(i) for i in range(len(ms))], [None] * len(ms), 1.0, 0.08, bounds=bounds)
    _legend_proxies(ax, ax.get_lines()[len(cs):])
    band = cfg.episodes if cfg is not None else EpisodeBand()
    crosses = _mark_episodes(ax, cs, group_marks(distinct.runs, by, band), 1.0, bounds)
    # references drawn after the curves (legend order) but beneath them (zorder)
    ax.axhspan(*ACCEPTABLE, color="#E69F00", alpha=0.14, linewidth=0, zorder=0,
               label="usual acceptable bound (1.03–1.05)")
    _log_excess_axis(ax, [*cs, *ms], floor, exact)
    if exact:
        _draw_floor(ax, floor, ms)
    variants = sorted({r.get(TAG_IS, "?") for r in distinct.runs})
    seeds = len({r.get(TAG_SEED, "?") for r in distinct.runs})
    pooled = (f"runs per recipe = {seeds} seeds × {len(variants)} IS settings"
              if len(variants) > 1 and TAG_IS not in by else "")
    order = order_note(data, cfg)
    note = ci_note(cs, pooled) + (f"\n{_matched_note(ms)}" if ms else "") + (f"\n{order}" if order else "")
    if crosses:
        note += (f"\n×: steps above {band.mismatch_above:g} of a run with an instability episode (more than "
                 f"{band.max_flagged_fraction:.0%} of its steps above it; analysis.episodes)")
    _finish(ax, "Figure 1 · Generation vs training mismatch", _subtitle(data), "RL step",
            "token_mult_prob_error  (log scale of ratio − 1)", note, "recipe")
    return fig


def _legend_proxies(ax, lines) -> None:
    """The shifted dashes of matched curves would start some legend samples in a gap (a dot or nothing):
    each curve's legend entry becomes an empty line with unshifted dashes; the curve keeps its label
    as `gid` (for whoever reads the figure back)."""
    for line in lines:
        label = line.get_label()
        line.set_gid(label)
        line.set_label(f"_{label}")
        ax.plot([], [], color=line.get_color(), linewidth=line.get_linewidth(), linestyle=(0, MATCHED_LEGEND),
                label=label)


def _matched_note(ms: Sequence[Curve]) -> str:
    counts = sorted({int(c.n.max()) for c in ms if c.n.size})
    n = "/".join(str(k) for k in counts) or "?"
    return (f"dashed: matched kernels (the trainer replays the generation engine: the zero-mismatch floor), "
            f"mean over {n} run{'' if n == '1' else 's'} each")


def accuracy_figure(data: SweepData, by: Sequence[str] = (TAG_RECIPE, TAG_IS), metric: str = M_VAL_ACC,
                    band: EpisodeBand | None = None):
    """Figure 2 as a matplotlib Figure (not saved): one curve per recipe × IS of `metric`, distinct kernels;
    crosses where a run with an instability episode under `band` (default: the default band) was flagged."""
    band = band or EpisodeBand()
    data = only_kernels(data)
    cs = curves(data, metric, by=by)
    recipes = [c.group.get(TAG_RECIPE, "?") for c in cs]
    variants = [c.group.get(TAG_IS, "none") for c in cs]
    scale = 100.0 if all(np.nanmax(np.abs(c.values)) <= 1.0 for c in cs) else 1.0  # fractions: show %
    fig, ax = plt.subplots(figsize=(9.5, 5.2), layout="constrained")
    labels = [f"{r} · {is_label(v)}" for r, v in zip(recipes, variants)]
    _plot(ax, cs, labels, [recipe_color(r, recipes) for r in recipes], [is_style(v, variants) for v in variants],
          [IS_MARKERS.get(v, "P") for v in variants], scale, 0.09, bounds=(0.0, scale))
    crosses = _mark_episodes(ax, cs, group_marks(data.runs, by, band, key=metric), scale, (0.0, scale))
    note = ci_note(cs) + (f"\n×: validation steps of a run with an instability episode: more than "
                          f"{band.accuracy_drop:g} pts below its best earlier validation, or inside its mismatch "
                          f"episode (analysis.episodes)" if crosses else "")
    engine = " (one BF16 evaluation engine for every arm)" if metric == M_VAL_ACC_BF16_EVAL else ""
    what = ACCURACY_LABELS.get(metric, metric)
    _finish(ax, f"Figure 2 · Validation accuracy{engine}", _subtitle(data), "RL step",
            f"{what} (%, pass@1 at rollout T)" if scale == 100 else what, note, "recipe · importance sampling")
    return fig


def _subtitle(data: SweepData) -> str:
    matched = len(only_kernels(data, MATCHED).runs)
    head = f"sweep {data.sweep_name or '?'} · {len(data.runs)} runs"
    return head + (f" ({matched} with matched kernels)" if matched else "")


def make_figures(data: SweepData, out_dir: str | Path, cfg: AnalysisConfig | None = None) -> dict[str, list[Path]]:
    """Both figures as PNG + SVG under `out_dir`: `{"fig1": [png, svg], "fig2": [png, svg]}`; Figure 2
    plots `cfg.accuracy_metric`."""
    cfg = cfg or AnalysisConfig()
    return {"fig1": save(mismatch_figure(data, cfg=cfg), out_dir, FIG1),
            "fig2": save(accuracy_figure(data, metric=cfg.accuracy_metric, band=cfg.episodes), out_dir, FIG2)}
