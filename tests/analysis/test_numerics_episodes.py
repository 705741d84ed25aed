"""Instability episodes in the numerics report: detection wired into `analyze`, rates per knob setting
(against scipy's exact interval), the sensitivity line (the paired effects re-run without the flagged
runs, checked against an independent `analyze` of the kept runs), Figure 3's crosses, and every output
of the report with the child runs' MLflow tags on a real SQLite store.

The runs are test_numerics' constant histories with its two mismatch spikes removed (two steps of ten
above the band would flag every run), plus an injected collapse or accuracy drop where a test wants one.
"""
from __future__ import annotations

import json

import matplotlib
import numpy as np
import pytest
from matplotlib.collections import PathCollection
from mlflow import MlflowClient
from scipy import stats
from test_numerics import ARMS, BASE_ACC, BASE_EXCESS, BASE_KL, _run, numerics_runs

from analysis.config import AnalysisConfig
from analysis.episodes import RATE_LEVEL, detect_all
from analysis.figures import EPISODE_LABEL
from analysis.kernel_match import KERNELS_PARAM, MATCHED
from analysis.numerics import MISMATCH_LOG, NumericsReport, analyze, figure_metrics, numerics_figure, result_json
from analysis.numerics_arms import DEFAULT_ARM, TOO_FEW, arm_label
from analysis.report import make_report
from analysis.synthetic import log_sweep
from fp8rl_core.tracking import M_MISMATCH, M_VAL_ACC, TAG_EPISODE, TAG_EPISODE_STEPS, TAG_SEED

matplotlib.use("Agg")
CFG = AnalysisConfig(kind="numerics")
COLLAPSE = slice(2, 7)  # steps 2-6 of 10 at a mismatch in the hundreds: a mismatch episode


def calm(runs):
    """The runs without test_numerics' spikes (each spike step back to the run's constant value)."""
    for run in runs:
        mm = run.metrics[M_MISMATCH][1]
        mm[mm == mm.max()] = mm.min()
    return runs


def _find(runs, arm: str, seed: int):
    return next(r for r in runs if arm_label(r.params) == arm and r.tags[TAG_SEED] == str(seed))


def collapse(run) -> None:
    run.metrics[M_MISMATCH][1][COLLAPSE] = 300.0


def accuracy_drop(run) -> None:
    """The middle validation 30 pts above the final one: the final validation is flagged, the final value kept."""
    acc = run.metrics[M_VAL_ACC][1]
    acc[1] = acc[-1] + 0.30


def _expected_changes(result, kept, cfg):
    """Every (knob, metric key, before, after) verdict that differs, from an independent analyze."""
    again = {a.label: a for a in analyze(kept, cfg, episodes=False).compared}
    out = []
    for arm in result.compared:
        for m in result.metrics:
            before = arm.effects[m.key].verdict
            after = again[arm.label].effects[m.key].verdict if arm.label in again else TOO_FEW
            if before != after:
                out.append((arm.label, m.key, before, after))
    return out


# --- detection and rates ---------------------------------------------------------------------------


def test_detection_is_wired_into_the_result_with_rates_per_knob_setting():
    runs = calm(numerics_runs())
    run = _find(runs, "fp8.format=nvfp4", 1)
    collapse(run)
    matched = _run("matched", 0, {KERNELS_PARAM: MATCHED}, 0.0, 0.0, 0.6)
    collapse(matched)  # a floor run: flagged and tagged, but in no rate and no effect
    runs.append(matched)
    result = analyze(runs, CFG)
    sec = result.episodes
    assert sec is not None and sec.runs == detect_all(runs, CFG)  # every run, matched too, in order
    flagged = [name for _, name in sec.flagged_named()]
    assert flagged == ["fp8.format=nvfp4/seed 1", "default/seed 0, matched kernels"]
    assert sec.flagged[0].ranges == ((2, 6),) and sec.flagged[0].mismatch_episode
    assert [a.group["arm"] for a in sec.arms] == [a.label for a in result.arms]  # the effects' order
    for a in sec.arms:
        k = int(a.group["arm"] == "fp8.format=nvfp4")
        ci = stats.binomtest(k, 3).proportion_ci(RATE_LEVEL, method="exact")
        assert (a.rate.k, a.rate.n) == (k, 3) and a.rate.ci == pytest.approx((ci.low, ci.high))
        assert a.flagged == (("fp8.format=nvfp4/seed 1",) if k else ())
    js = result_json(result, CFG, {})["episodes"]
    assert js["flagged"] == flagged and [r["label"] for r in js["runs"]][-1] == flagged[-1]
    assert js["sensitivity"]["left_out"] == ["fp8.format=nvfp4/seed 1"]  # matched runs enter no effect
    assert "flagged: fp8.format=nvfp4/seed 1 at steps 2-6 (5 of 10 steps above 1.1" in sec.text()
    assert "| fp8.format=nvfp4/seed 1 | 5/10 (50%) | 2-6 |" in sec.markdown()
    assert analyze(runs, CFG, episodes=False).episodes is None


@pytest.mark.parametrize("band,flags", [({}, True), ({"max_flagged_fraction": 0.25}, False)])
def test_the_declared_band_decides(band, flags):
    """test_numerics' spikes are 2 of 10 steps: an episode at the default 5%, none at 25%."""
    cfg = AnalysisConfig.from_dict({"kind": "numerics", "episodes": band})
    sec = analyze(numerics_runs(), cfg).episodes
    assert all(e.has_episode is flags for e in sec.runs)
    if flags:  # every default run is left out: no pair is left
        assert sec.sensitivity.no_default and sec.sensitivity.line.endswith(
            f"no default run is left, so every knob's verdict is {TOO_FEW}")
        assert {c[3] for c in sec.sensitivity.changes} == {TOO_FEW}
    else:
        assert sec.sensitivity.line.startswith("Sensitivity: no run is flagged (analysis.episodes)")


# --- the sensitivity line --------------------------------------------------------------------------


@pytest.mark.parametrize("arm,seed,inject", [("fp8.format=nvfp4", 2, accuracy_drop), (DEFAULT_ARM, 0, collapse)])
def test_leaving_out_a_flagged_run_changes_a_knob_verdict(arm, seed, inject):
    """A flagged knob run takes that knob's pair of its seed with it, a flagged default run its seed's
    pair of every knob; at 3 seeds the paired t interval of the 2 pairs left (t_{0.975,1} = 12.7) no
    longer excludes 0 for nvfp4's clear effects."""
    runs = calm(numerics_runs())
    flagged = _find(runs, arm, seed)
    inject(flagged)
    result = analyze(runs, CFG)
    sens = result.episodes.sensitivity
    want = _expected_changes(result, [r for r in runs if r is not flagged], CFG)
    assert want and any(k == "fp8.format=nvfp4" for k, *_ in want)
    assert sens.changes == want and not sens.no_default
    labels = {m.key: m.label for m in result.metrics}
    assert sens.line == (f"Sensitivity: leaving out the 1 flagged run ({arm}/seed {seed}), "
                         + "; ".join(f"{k} {labels[m]} changes {a} -> {b}" for k, m, a, b in want))
    assert sens.line in result.episodes.text()
    assert result.episodes.to_dict()["sensitivity"]["changes"][0] == dict(zip(("arm", "metric", "before", "after"),
                                                                               want[0]))


def test_leaving_out_a_flagged_run_that_no_verdict_rests_on():
    """A knob with no detectable effect on any metric (its seeds' differences cancel), whose flagged seed
    sits at no effect: without it the interval still holds 0."""
    arms = {"fp8.format=nvfp4": ARMS["fp8.format=nvfp4"],
            "fp8.lm_head=fp8": ({"fp8.lm_head": "fp8"}, [(2.0, 1e-4, 0.02), (0.5, -1e-4, -0.02), (1.0, 0.0, 0.0)])}
    runs = calm(numerics_runs(arms))
    flagged = _find(runs, "fp8.lm_head=fp8", 2)
    accuracy_drop(flagged)
    result = analyze(runs, CFG)
    assert _expected_changes(result, [r for r in runs if r is not flagged], CFG) == []
    assert [e.has_episode for e in result.episodes.runs] == [r is flagged for r in runs]
    assert result.episodes.sensitivity.line == ("Sensitivity: leaving out the 1 flagged run (fp8.lm_head=fp8/seed 2), "
                                                "no knob's verdict changes")


# --- Figure 3 --------------------------------------------------------------------------------------


def _crosses(ax) -> list[PathCollection]:
    return [c for c in ax.collections if isinstance(c, PathCollection) and c.get_label() == EPISODE_LABEL]


def test_figure_crosses_the_seeds_whose_pair_holds_a_flagged_run():
    runs = calm(numerics_runs())
    collapse(_find(runs, "fp8.format=nvfp4", 1))
    collapse(_find(runs, DEFAULT_ARM, 0))  # in every knob's pair of seed 0
    result = analyze(runs, CFG)
    fig = numerics_figure(result, CFG, "collapse")
    ys = np.arange(len(result.compared))[::-1]
    for ax, key in zip(fig.axes, figure_metrics(CFG)):
        got = np.concatenate([c.get_offsets() for c in _crosses(ax)])
        want = []
        for y, arm in zip(ys, result.compared):
            e = arm.effects[key]
            seeds = {"0", "1"} if arm.label == "fp8.format=nvfp4" else {"0"}
            d = np.asarray(e.differences)[[s in seeds for s in e.seeds]]
            x = 10.0 ** d if key == MISMATCH_LOG else d * (100.0 if key.startswith("final_") else 1.0)
            want += [(xi, y + 0.18) for xi in x]
        np.testing.assert_allclose(sorted(map(tuple, got)), sorted(want), rtol=1e-9)
    ticks = {t.get_text().split("\n")[0]: t.get_text() for t in fig.axes[0].get_yticklabels()}
    assert ticks["fp8.format=nvfp4"].endswith("\n1/3 runs flagged")
    assert all("\n" not in t for label, t in ticks.items() if label != "fp8.format=nvfp4")
    assert "crosses: seeds whose pair holds a run with an instability episode" in fig._suptitle.get_text()
    assert "default: 1/3 runs flagged" in fig._suptitle.get_text()
    quiet = numerics_figure(analyze(calm(numerics_runs()), CFG), CFG)
    assert not any(_crosses(ax) for ax in quiet.axes) and "crosses" not in quiet._suptitle.get_text()


# --- every output, and the child runs' tags --------------------------------------------------------


def test_report_lists_the_flagged_run_everywhere_and_tags_every_child_run(sqlite_uri, tmp_path):
    runs = calm([_run("default", s, {}, BASE_EXCESS[s], BASE_KL[s], BASE_ACC[s]) for s in range(3)]
                + numerics_runs({k: ARMS[k] for k in ("fp8.format=nvfp4", "fp8.bf16_last_layers=2")}, default=False))
    run = _find(runs, "fp8.format=nvfp4", 1)
    collapse(run)
    parent = log_sweep(sqlite_uri, "fp8rl", "numerics", runs)
    client = MlflowClient(sqlite_uri)
    quiet = make_report(sqlite_uri, "fp8rl", "numerics", tmp_path / "quiet", config=CFG, log_artifacts=False)
    assert quiet.logged_to is None and TAG_EPISODE not in client.get_run(run.run_id).data.tags  # no logging, no tags
    rep = make_report(sqlite_uri, "fp8rl", "numerics", tmp_path / "out", config=CFG)
    assert isinstance(rep, NumericsReport) and rep.logged_to == parent and rep.episodes is rep.result.episodes
    for r in runs:
        tags = client.get_run(r.run_id).data.tags
        want = ("true", f"{COLLAPSE.start}-{COLLAPSE.stop - 1}") if r is run else ("false", "none")
        assert (tags[TAG_EPISODE], tags[TAG_EPISODE_STEPS]) == want, r.run_name
    label, line = "fp8.format=nvfp4/seed 1", rep.episodes.sensitivity.line
    assert line.startswith(f"Sensitivity: leaving out the 1 flagged run ({label}), ")
    assert f"flagged: {label} at steps 2-6 (" in rep.verdicts_text and line in rep.verdicts_text
    for md in (rep.report, rep.table_md):
        section = md.read_text().split("## Instability episodes")[1]
        assert f"| {label} | 5/10 (50%) | 2-6 |" in section and "| fp8.format=nvfp4 | 1/3 |" in section
        assert line + "." in section
    js = json.loads(rep.json.read_text())["episodes"]
    assert js == json.loads(json.dumps(rep.verdicts["episodes"])) and js["flagged"] == [label]
    assert [(a["arm"], a["k"], a["n"]) for a in js["arms"]] == [(a.label, int(a.label == "fp8.format=nvfp4"), 3)
                                                                 for a in rep.result.arms]
    assert js["sensitivity"]["line"] == line and js["sensitivity"]["changes"]
