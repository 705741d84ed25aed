"""Figures 1 and 2: files written, and the right curves, bands, labels and legend on the axes."""
from __future__ import annotations

import matplotlib
import numpy as np
import pytest
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_hex

from analysis.aggregate import curves
from analysis.fetch import SweepData
from analysis.figures import ACCEPTABLE, IS_STYLES, RECIPE_COLORS, accuracy_figure, make_figures, mismatch_figure
from analysis.synthetic import synthetic_runs

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def data() -> SweepData:
    runs = synthetic_runs(seeds=3, steps=21)
    for i, r in enumerate(runs):
        r.run_id = f"r{i}"
    return SweepData("sqlite:///x.db", "1", "synthetic", "p", runs)


def _texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.findobj(matplotlib.text.Text))


def test_files_are_written(data, tmp_path):
    paths = make_figures(data, tmp_path)
    for png, svg in paths.values():
        assert png.stat().st_size > 20_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert svg.stat().st_size > 20_000 and b"<svg" in svg.read_bytes()[:500]
        image = matplotlib.image.imread(png)
        assert image.shape[1] > 1000 and image[..., :3].std() > 0.05  # not blank


def test_figure1_one_curve_per_recipe_with_bands_and_acceptable_region(data):
    fig = mismatch_figure(data)
    ax = fig.axes[0]
    lines = [line for line in ax.get_lines() if line.get_label() in RECIPE_COLORS]
    assert [line.get_label() for line in lines] == ["bf16", "fp8_gen", "fp8_e2e"]
    for line in lines:
        assert to_hex(line.get_color()) == RECIPE_COLORS[line.get_label()].lower()
    expected = {tuple(c.group.values()): c for c in curves(data, "token_mult_prob_error", by=("recipe",))}
    np.testing.assert_allclose(lines[0].get_ydata(), expected[("bf16",)].mean)
    bands = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 3
    span = [p for p in ax.patches if p.get_label().startswith("usual acceptable")]
    corners = span[0].get_path().transformed(span[0].get_patch_transform()).vertices
    (y0, y1) = sorted({round(v, 6) for v in corners[:, 1]})
    assert (y0, y1) == ACCEPTABLE
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:3] == ["bf16", "fp8_gen", "fp8_e2e"] and any("1.03–1.05" in t for t in legend)
    assert ax.get_xlabel() == "RL step" and "token_mult_prob_error" in ax.get_ylabel()
    assert "Figure 1" in ax.get_title(loc="left")
    text = _texts(fig)
    assert "mean ± 95% CI (Student t over 6 runs" in text and "3 seeds × 2 IS settings" in text
    assert "paired per step" in text and "bf16 < fp8_gen at" in text and "fp8_e2e < fp8_gen at" in text
    assert "(mean over 3 seeds, 95% t interval)" in text and "\n" in text
    bbox = ax.get_legend().get_window_extent(fig.canvas.get_renderer())
    assert bbox.x0 >= ax.get_window_extent(fig.canvas.get_renderer()).x1  # legend outside the data


def test_figure2_one_curve_per_recipe_and_is(data):
    fig = accuracy_figure(data)
    ax = fig.axes[0]
    lines = ax.get_lines()
    assert len(lines) == 6
    labels = [line.get_label() for line in lines]
    assert labels[:2] == ["bf16 · no IS", "bf16 · IS token"]
    for line in lines:
        recipe, isv = line.get_label().split(" · ")
        assert to_hex(line.get_color()) == RECIPE_COLORS[recipe].lower()
        assert line.get_linestyle() == {"no IS": "-", "IS token": "--"}[isv]
    ys = np.concatenate([line.get_ydata() for line in lines])
    assert 20 < ys.min() and ys.max() < 90  # fractions shown as %
    assert "%" in ax.get_ylabel() and ax.get_xlabel() == "RL step"
    assert "mean ± 95% CI (Student t over 3 seeds)" in _texts(fig)
    assert IS_STYLES["none"] == "-"


def test_single_seed_has_no_band_and_says_so():
    runs = synthetic_runs(seeds=1, steps=6)
    data = SweepData("u", "1", "one-seed", None, runs)
    fig = accuracy_figure(data)
    assert not [c for c in fig.axes[0].collections if isinstance(c, PolyCollection)]
    assert "over 1 seed)" in _texts(fig) and "no band where fewer than 2" in _texts(fig)


def test_no_values_yet_still_draws(tmp_path):
    runs = synthetic_runs(seeds=2, steps=3)
    for r in runs:
        del r.metrics["val_accuracy"]
    paths = make_figures(SweepData("u", "1", "early", None, runs), tmp_path)
    assert all(p.exists() for ps in paths.values() for p in ps)
    fig = accuracy_figure(SweepData("u", "1", "early", None, runs))
    assert "no values logged yet" in _texts(fig)


def test_figure1_axis_is_log_of_excess_labelled_in_ratio_units(data):
    # heavy-tailed spikes must not flatten the curves: equal ratios of (value - 1) get equal heights
    ax = mismatch_figure(data).axes[0]
    assert ax.get_yscale() == "function"
    to_axes = lambda y: ax.transAxes.inverted().transform(ax.transData.transform((0, y)))[1]  # noqa: E731
    y1, y2, y3 = (ax.transData.transform((0, v))[1] for v in (1.001, 1.01, 1.1))
    np.testing.assert_allclose(y2 - y1, y3 - y2, rtol=1e-6)
    labels = {t.get_text() for t in ax.get_yticklabels()}
    assert {"1.01", "1.1", "2"} & labels
    bottom, top = ax.get_ylim()
    assert 1.0 < bottom < 1.0 + 1e-2 and 0 <= to_axes(1.04) <= 1  # the acceptable band is in view
    for band in (c for c in ax.collections if isinstance(c, PolyCollection)):
        assert band.get_paths()[0].vertices[:, 1].min() > 1.0  # CI clipped: the ratio is never below 1


def test_order_note_is_the_claims_paired_step_statistic(data):
    from analysis.claims import step_order
    from analysis.config import AnalysisConfig
    from analysis.figures import order_note

    o = step_order(data.runs, "bf16", "fp8_e2e", AnalysisConfig())
    assert f"bf16 < fp8_e2e at {o['fraction']:.0%} [{o['ci'][0]:.0%}, {o['ci'][1]:.0%}]" in order_note(data)
    only_bf16 = SweepData("u", "1", "x", None, [r for r in data.runs if r.get("recipe") == "bf16"])
    assert order_note(only_bf16) == ""


@pytest.fixture(scope="module")
def with_floor() -> SweepData:
    """The study with matched-kernel cells (IS none, same seeds) beside the distinct ones, and the BF16 eval."""
    runs = synthetic_runs(seeds=3, steps=21, matched=("bf16", "fp8_gen", "fp8_e2e"), bf16_eval=True)
    for i, r in enumerate(runs):
        r.run_id = f"r{i}"
    return SweepData("sqlite:///x.db", "1", "floor", "p", runs)


def _matched_lines(ax) -> dict[str, matplotlib.lines.Line2D]:
    return {line.get_gid(): line for line in ax.get_lines() if (line.get_gid() or "").endswith("matched kernels")}


def test_figure1_draws_matched_kernels_dashed_and_their_exact_floor(with_floor):
    from analysis.figures import EXACT_LABEL, axis_floor, matched_style
    from analysis.kernel_match import KERNELS, MATCHED, only_kernels

    fig = mismatch_figure(with_floor)
    ax = fig.axes[0]
    solid = [line for line in ax.get_lines() if line.get_label() in RECIPE_COLORS]
    expected = {c.group["recipe"]: c for c in curves(only_kernels(with_floor), "token_mult_prob_error", by=("recipe",))}
    np.testing.assert_allclose(solid[0].get_ydata(), expected["bf16"].mean)  # distinct runs only, as before
    matched = _matched_lines(ax)
    assert list(matched) == [f"{r}, matched kernels" for r in ("bf16", "fp8_gen", "fp8_e2e")]
    for name, line in matched.items():
        recipe = name.split(",")[0]
        assert to_hex(line.get_color()) == RECIPE_COLORS[recipe].lower() and line.get_linestyle() != "-"
    # bf16 and fp8_e2e both lie on the floor: their dashes must interleave, not cover each other
    styles = [matched_style(i) for i in range(3)]
    (on, off), starts = styles[0][1], [offset for offset, _ in styles]
    assert sorted(starts) == [0, on, 2 * on] and on + off >= 3 * on  # three disjoint dashes per period
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:6] == ["bf16", "fp8_gen", "fp8_e2e", "bf16, matched kernels", "fp8_gen, matched kernels",
                          "fp8_e2e, matched kernels"]
    # ratio exactly 1 (bf16, fp8_e2e): drawn on a labelled floor inside the axes, below every measured value
    per_kernels = [curves(only_kernels(with_floor, k), "token_mult_prob_error", by=("recipe",)) for k in KERNELS]
    floor, exact = axis_floor([c for cs in per_kernels for c in cs])
    assert exact and floor == 1e-4  # the smallest measured excess (bf16, ~0.004) lies in [10 F, 100 F)
    gen = curves(only_kernels(with_floor, MATCHED), "token_mult_prob_error", by=("recipe",))[1]
    np.testing.assert_allclose(matched["fp8_gen, matched kernels"].get_ydata(), gen.mean)
    to_axes = lambda y: ax.transAxes.inverted().transform(ax.transData.transform((0, y)))[1]  # noqa: E731
    for recipe in ("bf16", "fp8_e2e"):
        y = matched[f"{recipe}, matched kernels"].get_ydata()
        assert (y == 1.0 + floor).all() and 0.0 < to_axes(y[0]) < to_axes(1.001)
    ticks = dict(zip((t.get_text() for t in ax.get_yticklabels()), ax.get_yticks()))
    assert ticks[EXACT_LABEL] == 1.0 + floor and "1.001" in ticks
    assert "ratio = 1 exactly at every step: bf16, fp8_e2e (matched kernels)" in _texts(fig)
    assert "dashed: matched kernels" in _texts(fig) and "3 seeds × 2 IS settings" in _texts(fig)
    assert "27 runs (9 with matched kernels)" in ax.get_title(loc="left")


def test_figure1_without_exact_values_keeps_its_axis(data):
    from analysis.figures import EXACT_LABEL, EXCESS_FLOOR, axis_floor

    assert axis_floor(curves(data, "token_mult_prob_error", by=("recipe",))) == (EXCESS_FLOOR, False)
    ax = mismatch_figure(data).axes[0]
    assert EXACT_LABEL not in {t.get_text() for t in ax.get_yticklabels()} and not _matched_lines(ax)


def test_figure2_plots_the_deciding_metric_of_distinct_runs(with_floor):
    from analysis.kernel_match import only_kernels

    ax = accuracy_figure(with_floor, metric="val_accuracy_bf16_eval").axes[0]
    lines = ax.get_lines()
    assert len(lines) == 6  # the matched-kernel runs are not arms of the study
    expected = curves(only_kernels(with_floor), "val_accuracy_bf16_eval")
    np.testing.assert_allclose(lines[2].get_ydata(), expected[2].mean * 100)
    assert "BF16 eval engine" in ax.get_ylabel() and "one BF16 evaluation engine" in ax.get_title(loc="left")
    own = accuracy_figure(with_floor).axes[0]
    own_means = curves(only_kernels(with_floor), "val_accuracy")[2].mean * 100
    np.testing.assert_allclose(own.get_lines()[2].get_ydata(), own_means)
