"""Figure 3 of the numerics study (`fig3_numerics`): one panel per figure metric, one row per knob arm,
its per-seed differences, the mean and its paired interval (the styles and `save` of `analysis.figures`).

    fig = numerics_figure(result, cfg, sweep_name)     # a matplotlib Figure, not saved
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

from analysis.config import AnalysisConfig  # noqa: E402
from analysis.figures import EPISODE_LABEL, EPISODE_MARKER  # noqa: E402
from analysis.numerics_effects import NumericsResult, figure_metrics  # noqa: E402
from analysis.numerics_table import arm_cell  # noqa: E402

FIG3 = "fig3_numerics"


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
    axes[0].set_yticks(ys, [arm_cell(a) + (eps.tick(a.label) if eps else "") for a in arms])
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
