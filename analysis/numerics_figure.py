"""Figure 3 of the numerics study (`fig3_numerics`): one panel per figure metric, one row per knob arm,
its per-seed differences, the mean and its paired interval (the styles and `save` of `analysis.figures`).

    fig = numerics_figure(result, cfg, sweep_name)      # one sweep's report: a matplotlib Figure, not saved
    fig = sections_figure(sections, keys, title)        # several reports' rows, one block each (analysis.numerics_join)

A section is a header (None: no header row) with one result's compared arms; each section's effects are against
its own reference arm (`result.base`), so a block's header names it when there are several.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import matplotlib.transforms  # noqa: E402
import numpy as np  # noqa: E402

from analysis.config import AnalysisConfig  # noqa: E402
from analysis.figures import EPISODE_LABEL, EPISODE_MARKER  # noqa: E402
from analysis.numerics_effects import Arm, Metric, NumericsResult, figure_metrics  # noqa: E402
from analysis.numerics_table import arm_cell  # noqa: E402

FIG3 = "fig3_numerics"


class Marks(Protocol):
    """What the figure reads of a result's episodes (`NumericsEpisodes`, or the join's view of a JSON file)."""

    def pair_seeds(self, arm: str) -> set[str]: ...
    def tick(self, arm: str) -> str: ...
    def figure_note(self) -> str: ...


Section = tuple["str | None", Sequence[Arm], "Marks | None"]  # (header, compared arms, episode marks)


def numerics_figure(result: NumericsResult, cfg: AnalysisConfig, sweep_name: str | None = None):
    """Figure 3 as a matplotlib Figure (not saved)."""
    pct, eps = f"{result.confidence:.0%}", result.episodes
    note = eps.figure_note() if eps else ""
    what = "Numerics knobs of fp8_e2e" if not result.reference else "Numerics knobs"  # the default arm: fp8_e2e's
    title = (f"Figure 3 · {what} vs {result.base_text}, paired by seed "
             f"(sweep {sweep_name or '?'}, n = {result.seeds_range()} seeds per knob)\n"
             f"diamond: mean difference (knob − {result.base}); bar: {pct} paired t interval; dots: seeds; "
             "knobs ordered by their effect on the mismatch" + (f"\n{note}" if note else ""))
    return sections_figure([(None, result.compared, eps)], [m for k in figure_metrics(cfg) for m in result.metrics
                                                             if m.key == k], title, result.base)


def _rows(sections: Sequence[Section]) -> list[tuple[str, Arm | None, Marks | None]]:
    """Top to bottom: (tick label, arm or None for a header row, marks)."""
    rows: list[tuple[str, Arm | None, Marks | None]] = []
    for header, arms, eps in sections:
        if header is not None:
            rows.append((header, None, None))
        rows += [(arm_cell(a) + (eps.tick(a.label) if eps else ""), a, eps) for a in arms]
    return rows


def sections_figure(sections: Sequence[Section], metrics: Sequence[Metric], title: str, base: str = "reference"):
    """One panel per metric, one row per arm of every section (in order, a header row before each titled one)."""
    rows = _rows(sections)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 1.6 + 0.45 * max(len(rows), 1)),
                             sharey=True, layout="constrained")
    ys = np.arange(len(rows))[::-1]  # the first row at the top
    for ax, m in zip(axes, metrics):
        _panel(ax, m, rows, ys, base)
        ax.set_ylim(-0.7, len(rows) - 0.3)
    axes[0].set_yticks(ys, ["" if arm is None else label for label, arm, _ in rows])
    across = matplotlib.transforms.blended_transform_factory(axes[0].transAxes, axes[0].transData)
    axes[0].set_zorder(1)  # drawn last: its header texts run over the other panels
    for y, (label, arm, _) in zip(ys, rows):
        if arm is None:  # a block's header: left-aligned in its own row, over the panels (the row has no data)
            axes[0].text(0.01, y, label, transform=across, ha="left", va="center", fontweight="bold",
                         bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0},
                         clip_on=False, in_layout=False)  # not in the layout: the panels keep their widths
    fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    if not any(arm for _, arm, _ in rows):
        axes[0].text(0.5, 0.5, "no knob arms yet", transform=axes[0].transAxes, ha="center", color="#777777")
    return fig


def _panel(ax, m: Metric, rows: Sequence[tuple[str, Arm | None, Marks | None]], ys: np.ndarray, base: str) -> None:
    def tr(v):  # display units: a ratio for the log effect, points for accuracy
        return 10.0 ** np.asarray(v) if m.log_ratio else np.asarray(v) * m.scale

    for y, (_, arm, eps) in zip(ys, rows):
        if arm is None:
            continue
        e = arm.effects[m.key]
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
        ax.set_xlabel(f"excess mismatch ratio (median − 1),\nknob / {base}")
    else:
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))  # plain labels: no offset text
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.3g}"))
        ax.axvline(0.0, color="#333333", linewidth=1.0, zorder=1)
        ax.set_xlabel(f"Δ {m.label}" + (" (points)" if m.unit else "") + f",\nknob − {base}")
    ax.set_title(m.label, loc="left", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3, linewidth=0.6)
    ax.spines[["top", "right"]].set_visible(False)
