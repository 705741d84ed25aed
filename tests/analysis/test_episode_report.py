"""Instability episodes in the report: the sensitivity line (claims re-checked without the flagged runs),
the figures' markers, and every output of `make_report` (table, claims text, JSON, report.md, the child
runs' MLflow tags) on a real SQLite store."""
from __future__ import annotations

import csv

import matplotlib
import numpy as np
import pytest
from matplotlib.collections import PathCollection
from mlflow import MlflowClient

from analysis.aggregate import curves
from analysis.claims import check_claims
from analysis.config import AnalysisConfig
from analysis.episode_report import episode_section, sensitivity_line
from analysis.episodes import detect_all
from analysis.fetch import SweepData
from analysis.figures import EPISODE_LABEL, accuracy_figure, mismatch_figure
from analysis.report import make_report
from analysis.synthetic import constant_runs, log_sweep, synthetic_runs
from fp8rl_core.tracking import M_MISMATCH, M_VAL_ACC, TAG_EPISODE, TAG_EPISODE_STEPS

matplotlib.use("Agg")
CFG = AnalysisConfig(bootstrap_resamples=200)
EPISODE = range(8, 14)  # the injected collapse's steps (of 21)
VAL_DROP = 10  # the validation step (val_every 5) where its accuracy falls 30 pts


def _cell(runs, cell_id: str):
    return next(r for r in runs if r.tags["cell_id"] == cell_id)


def with_collapse(seeds: int = 3, cell_id: str = "fp8_e2e-token-2"):
    """The synthetic study with one run collapsing: mismatch in the hundreds at EPISODE, one step of it
    under the band (bridged), and its accuracy 30 pts under its best earlier validation at VAL_DROP."""
    runs = synthetic_runs(seeds=seeds, steps=21)
    run = _cell(runs, cell_id)
    _, mm = run.metrics[M_MISMATCH]
    mm[list(EPISODE)] = [310.0, 900.0, 1.05, 2416.0, 2659.0, 400.0]
    steps, acc = run.metrics[M_VAL_ACC]
    acc[steps == VAL_DROP] = acc[steps < VAL_DROP].max() - 0.30
    return runs, run


# --- the sensitivity line ------------------------------------------------------------------------------


def test_leaving_out_a_flagged_run_that_carries_claim_4_changes_its_verdict():
    """Claim 4 (TOST ±2 pts) on 4 seeds, one of whose fp8_e2e+token runs lost 15 pts at its last validation
    (0.30 -> 0.15): with it the interval is wide; without it the 3 close pairs show equivalence."""
    runs = constant_runs(mismatch={"bf16": [1.001] * 4, "fp8_e2e": [1.02, 1.021, 1.019, 1.02]},
                         acc={("bf16", "token"): [0.70, 0.71, 0.72, 0.73],
                              ("fp8_e2e", "token"): [0.701, 0.709, 0.7205, 0.15]})
    results = check_claims(runs, CFG)
    sec = episode_section(runs, results, CFG)
    assert [e.label for e in sec.flagged] == ["fp8_e2e/token/seed 3"] and sec.flagged[0].accuracy_episode
    kept = [r for r in runs if r.run_id != "fp8_e2e-token-3"]
    again = check_claims(kept, CFG)  # independently: the claims on the runs without the flagged one
    changes = [(a.number, a.status, b.status) for a, b in zip(results, again) if a.status != b.status]
    assert [n for n, _, _ in changes] == [4] and again[3].comparisons[0].n == 3  # the seed's pair left out
    assert sec.sensitivity.changes == changes and sec.sensitivity.statuses == [r.status for r in again]
    assert sec.sensitivity.line == ("Sensitivity: leaving out the 1 flagged run (fp8_e2e/token/seed 3), "
                                    f"claim 4 changes {changes[0][1]} -> {changes[0][2]}")
    assert sec.sensitivity.line in sec.text() and sec.to_dict()["sensitivity"]["changes"][0]["claim"] == 4


def test_leaving_out_a_flagged_run_that_no_verdict_rests_on():
    runs, run = with_collapse(cell_id="fp8_e2e-none-0")  # claim 4 reads IS token; claims 1–2 medians
    results = check_claims(runs, CFG)
    sec = episode_section(runs, results, CFG)
    assert [e.label for e in sec.flagged] == ["fp8_e2e/none/seed 0"]
    again = check_claims([r for r in runs if r is not run], CFG)
    assert [r.status for r in again] == [r.status for r in results]
    assert sec.sensitivity.line == ("Sensitivity: leaving out the 1 flagged run (fp8_e2e/none/seed 0), no claim's "
                                    "verdict changes")


def test_no_flagged_run_is_said_in_the_same_line():
    runs = synthetic_runs(seeds=2, steps=11)
    sec = episode_section(runs, check_claims(runs, CFG), CFG)
    assert sec.flagged == [] and sec.sensitivity.left_out == [] and sec.sensitivity.statuses == []
    assert sec.sensitivity.line.startswith("Sensitivity: no run is flagged (analysis.episodes)")
    assert "flagged: none" in sec.text() and "No run has an instability episode." in sec.markdown()
    assert sensitivity_line(["a", "b"], [(3, "PASS", "FAIL"), (4, "PASS", "INCONCLUSIVE")]) == (
        "Sensitivity: leaving out the 2 flagged runs (a, b), claim 3 changes PASS -> FAIL; claim 4 changes "
        "PASS -> INCONCLUSIVE")


def test_a_run_left_out_drops_its_pairs_and_an_arm_left_empty_is_inconclusive():
    """The claims pair by seed: a missing run removes that seed's pair (claim 4: one IS setting) or the
    seed's pair in that IS setting (claims 1–2 average a seed's settings), and never raises."""
    runs = synthetic_runs(seeds=4, steps=11)
    full = check_claims(runs, CFG)
    fewer = check_claims([r for r in runs if r.tags["cell_id"] != "fp8_e2e-token-3"], CFG)
    assert [c.n for c in full[3].comparisons] == [4] and [c.n for c in fewer[3].comparisons] == [3]
    assert [c.n for c in fewer[0].comparisons] == [4, 4]  # seed 3 stays through its IS-none pair
    no_bf16 = check_claims([r for r in runs if r.tags["recipe"] != "bf16"], CFG)
    assert [no_bf16[i].status for i in (0, 2, 3)] == ["INCONCLUSIVE"] * 3


# --- the figures ---------------------------------------------------------------------------------------


def _crosses(ax) -> list[PathCollection]:
    return [c for c in ax.collections if isinstance(c, PathCollection) and EPISODE_LABEL in c.get_label()]


def test_figures_mark_the_flagged_steps_on_the_arms_curve():
    runs, run = with_collapse()
    data = SweepData("u", "1", "collapse", None, runs)
    ax = mismatch_figure(data).axes[0]
    (marks,) = _crosses(ax)
    flagged = [s for s in EPISODE if run.metrics[M_MISMATCH][1][s] > 1.1]
    e2e = next(c for c in curves(data, M_MISMATCH, by=("recipe",)) if c.group["recipe"] == "fp8_e2e")
    np.testing.assert_array_equal(marks.get_offsets()[:, 0], flagged)
    np.testing.assert_allclose(marks.get_offsets()[:, 1], e2e.mean[flagged])  # on the fp8_e2e curve
    assert EPISODE_LABEL in [t.get_text() for t in ax.get_legend().get_texts()]
    ax2 = accuracy_figure(data).axes[0]
    (marks2,) = _crosses(ax2)
    arm = next(c for c in curves(data, M_VAL_ACC) if c.group == {"recipe": "fp8_e2e", "importance_sampling": "token"})
    np.testing.assert_array_equal(marks2.get_offsets()[:, 0], [VAL_DROP])
    np.testing.assert_allclose(marks2.get_offsets()[:, 1], 100 * arm.mean[arm.steps == VAL_DROP])
    assert len(ax2.get_lines()) == 6  # the curves, nothing else: markers are one collection
    calm = SweepData("u", "1", "calm", None, synthetic_runs(seeds=3, steps=21))
    assert not _crosses(mismatch_figure(calm).axes[0]) and not _crosses(accuracy_figure(calm).axes[0])


# --- every output of make_report -------------------------------------------------------------------------


def test_report_flags_the_run_everywhere_and_tags_every_child_run(sqlite_uri, tmp_path):
    runs, run = with_collapse()
    parent = log_sweep(sqlite_uri, "fp8rl", "collapse", runs)
    client = MlflowClient(sqlite_uri)
    quiet = make_report(sqlite_uri, "fp8rl", "collapse", tmp_path / "quiet", config=CFG, log_artifacts=False)
    assert quiet.logged_to is None and TAG_EPISODE not in client.get_run(run.run_id).data.tags  # no logging, no tags
    paths = make_report(sqlite_uri, "fp8rl", "collapse", tmp_path / "report", config=CFG)
    assert paths.logged_to == parent
    flagged = [s for s in EPISODE if run.metrics[M_MISMATCH][1][s] > 1.1]
    steps_text = f"{flagged[0]}-{flagged[-1]}; val {VAL_DROP}"
    for r in runs:
        tags = client.get_run(r.run_id).data.tags
        want = ("true", steps_text) if r is run else ("false", "none")
        assert (tags[TAG_EPISODE], tags[TAG_EPISODE_STEPS]) == want, r.run_name
    label = "fp8_e2e/token/seed 2"
    text = paths.claims_txt.read_text()
    assert paths.verdicts_text + "\n" == text
    assert f"flagged: {label} at steps {flagged[0]}-{flagged[-1]} and validation step {VAL_DROP} (" in text
    assert f"Sensitivity: leaving out the 1 flagged run ({label})" in text and "fp8_e2e/token 1/3 [" in text
    js = paths.verdicts["episodes"]
    assert js["flagged"] == [label] and js["band"] == {"mismatch_above": 1.1, "max_flagged_fraction": 0.05,
                                                       "accuracy_drop": 10.0}
    arm = next(a for a in js["arms"] if (a["recipe"], a["importance_sampling"]) == ("fp8_e2e", "token"))
    assert (arm["k"], arm["n"]) == (1, 3) and "episodes" not in paths.verdicts["config"]  # config as before
    assert len(js["runs"]) == len(runs) and js["sensitivity"]["left_out"] == [label]
    report = paths.report.read_text()
    section = report.split("## Instability episodes")[1].split("## Summary")[0]
    assert f"| {label} | {len(flagged)}/21 (" in section and "Sensitivity: leaving out the 1 flagged run" in section
    assert "## Instability episodes" in paths.claims.read_text()
    with open(paths.table_csv) as f:
        rows = {(r["recipe"], r["importance_sampling"]): r for r in csv.DictReader(f)}
    assert {k: int(r["episodes"]) for k, r in rows.items()} == {k: int(k == ("fp8_e2e", "token")) for k in rows}
    truth = [e for e in detect_all(runs, CFG) if e.has_episode]
    assert [e.label for e in truth] == [label]  # the only episode is the injected one
    assert "| fp8_e2e | token | 3 |" in paths.table_md.read_text() and "| 1/3 [" in paths.table_md.read_text()


@pytest.mark.parametrize("band,flags", [({}, True), ({"episodes": {"mismatch_above": 5000, "accuracy_drop": 50}},
                                                     False)])
def test_the_declared_band_decides(band, flags):
    runs, _ = with_collapse()
    cfg = AnalysisConfig.from_dict({"bootstrap_resamples": 200, **band})
    sec = episode_section(runs, check_claims(runs, cfg), cfg)
    assert bool(sec.flagged) is flags and f"> {cfg.episodes.mismatch_above:g} on more than" in sec.markdown()


def test_a_run_whose_accuracy_only_rose_shows_no_drop():
    """A mismatch-only episode whose accuracy rose at every validation: its worst "drop" is negative (a
    rise), which the texts must not print as a fall."""
    from analysis.episode_report import _markdown_row, run_text
    from analysis.episodes import RunEpisodes

    e = RunEpisodes(recipe="fp8_e2e", importance_sampling="token", seed="2", run_id="r", kernels="distinct",
                    steps=80, flagged_steps=20, ranges=((54, 73),), peak_mismatch=2659.0, peak_step=72,
                    accuracy_steps=(), worst_drop=-10.0, worst_drop_step=40, mismatch_episode=True,
                    accuracy_episode=False)
    assert "drop" not in run_text(e, 1.1)
    assert _markdown_row(e, "x").endswith("| none |") and "-10" not in _markdown_row(e, "x")
    fell = RunEpisodes(**{**e.__dict__, "worst_drop": 41.0, "worst_drop_step": 60})
    assert "worst accuracy drop 41.0 pts at step 60" in run_text(fell, 1.1)
    assert "41.0 pts (60)" in _markdown_row(fell, "x")
