"""make_report: everything regenerated from MLflow and logged to the sweep's parent run."""
from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from analysis.claims import check_claims
from analysis.config import AnalysisConfig
from analysis.links import ARTIFACT_DIR, ui_link
from analysis.report import CLAIM_TAG, make_report
from analysis.synthetic import log_sweep, synthetic_runs


def test_report_files_and_parent_artifacts(sweep_store, tmp_path):
    paths = make_report(sweep_store.uri, sweep_store.experiment, sweep_store.sweep, tmp_path / "report")
    assert paths.logged_to == sweep_store.parent and paths.statuses == {"FINISHED": 18}
    names = sorted(p.name for p in paths.files())
    assert names == sorted(["report.md", "fig1_token_mult_prob_error.png", "fig1_token_mult_prob_error.svg",
                            "fig2_val_accuracy.png", "fig2_val_accuracy.svg", "summary.md", "summary.csv", "claims.md",
                            "claims.json", "claims.txt"])
    assert all(p.exists() and p.stat().st_size > 100 for p in paths.files())
    logged = {f.path for f in MlflowClient(sweep_store.uri).list_artifacts(sweep_store.parent, ARTIFACT_DIR)}
    assert logged == {f"{ARTIFACT_DIR}/{n}" for n in names}
    report = paths.report.read_text()
    assert "18 child runs (18 FINISHED)" in report and "](fig1_token_mult_prob_error.png)" in report
    fig1 = report.split("## Figure 1")[1].split("## Figure 2")[0]
    assert "Paired per step (same seed and IS setting), fraction of steps (mean over " in fig1
    assert "bf16 < fp8_gen at" in fig1
    summary = report.split("## Summary")[1].split("## Mismatch per run")[0]
    assert summary.count("| bf16 |") == 2 and "| 4 |" in report  # the table's bf16 rows; claim 4
    claims = paths.claims.read_text()
    assert all(f"| {i} |" in claims for i in range(1, 5))
    assert "## Mismatch per run: robust summaries and tails" in report and "IQM final val accuracy" in report
    tails = report.split("## Mismatch per run")[1].split("## RL")[0]
    rows = [line for line in tails.splitlines() if line.startswith("| fp8_gen | token |")]
    assert "P(X > Y)" in report and len(rows) == 1 and "n/a" not in rows[0]  # the store logged the token fractions


def test_report_returns_the_verdicts_from_mlflow_and_tags_the_parent(sweep_store, tmp_path):
    """End to end through the real store: the verdicts equal those on the exact values that were logged."""
    cfg = AnalysisConfig(equivalence_margin=3, bootstrap_resamples=500)
    paths = make_report(sweep_store.uri, sweep_store.experiment, sweep_store.sweep, tmp_path, config=cfg)
    truth = check_claims(sweep_store.runs, cfg)
    assert [r.status for r in paths.results] == [r.status for r in truth]
    assert [c.ci for r in paths.results for c in r.comparisons] == [c.ci for r in truth for c in r.comparisons]
    assert paths.verdicts_text.startswith("Claims (4): 1 ") and "±3 pts" in paths.verdicts_text
    assert paths.verdicts_text + "\n" == paths.claims_txt.read_text()
    assert json.loads(paths.claims_json.read_text()) == json.loads(json.dumps(paths.verdicts))
    assert paths.verdicts["config"]["equivalence_margin"] == 3
    tags = MlflowClient(sweep_store.uri).get_run(sweep_store.parent).data.tags
    assert {tags[CLAIM_TAG.format(r.number)] for r in paths.results} <= {"PASS", "FAIL", "INCONCLUSIVE"}
    assert [tags[CLAIM_TAG.format(i)] for i in range(1, 5)] == [r.status for r in paths.results]
    exp_id = MlflowClient(sweep_store.uri).get_experiment_by_name(sweep_store.experiment).experiment_id
    assert paths.ui_link.endswith(f"/#/experiments/{exp_id}/runs/{sweep_store.parent}?workflowType=machine_learning")


def test_ui_link():
    assert ui_link("http://mlflow.example:5000/", "7") == "http://mlflow.example:5000/#/experiments/7/runs?workflowType=machine_learning"
    assert ui_link("sqlite:///x.db", "1", "abc") == "http://127.0.0.1:5000/#/experiments/1/runs/abc?workflowType=machine_learning"


def test_mid_sweep_report(sqlite_uri, tmp_path):
    runs = synthetic_runs(seeds=2, steps=11)
    runs[0].metrics = {k: (s[:4], v[:4]) for k, (s, v) in runs[0].metrics.items()}  # still running, 4 steps in
    runs[0].status = "RUNNING"
    log_sweep(sqlite_uri, "fp8rl", "mid", runs)
    MlflowClient(sqlite_uri).update_run(runs[0].run_id, status="RUNNING")
    paths = make_report(sqlite_uri, "fp8rl", "mid", tmp_path, log_artifacts=False)
    assert paths.statuses == {"FINISHED": 11, "RUNNING": 1} and paths.logged_to is None
    assert "(11 FINISHED, 1 RUNNING)" in paths.report.read_text()


def test_report_of_unknown_sweep_is_an_error(sweep_store, tmp_path):
    with pytest.raises(ValueError, match="no child runs"):
        make_report(sweep_store.uri, sweep_store.experiment, "nope", tmp_path)


def _edited_sweep(uri: str) -> tuple[str, list, list]:
    """A sweep whose file was edited: its first version had other cells (say `model.dtype: fp32`), whose
    child runs stay under the same parent run next to the runs of the cells the file has now."""
    stale = synthetic_runs(recipes=("bf16", "fp8_gen"), is_variants=("none",), seeds=3, steps=11, rng_seed=9,
                           mismatch={"bf16": 1.5, "fp8_gen": 1.001}, final_acc={("bf16", "none"): 0.1})
    for r in stale:
        r.tags["cell_id"] = "fp32-" + r.tags["cell_id"]
    parent = log_sweep(uri, "fp8rl", "edited", stale)
    current = synthetic_runs(seeds=3, steps=11)
    assert log_sweep(uri, "fp8rl", "edited", current) == parent  # the same parent run, as `sweep run` does
    return parent, current, stale


def test_report_aggregates_only_the_cells_of_the_file_as_it_is_now(sqlite_uri, tmp_path):
    parent, current, stale = _edited_sweep(sqlite_uri)
    cell_ids = [r.tags["cell_id"] for r in current]
    cfg = AnalysisConfig(bootstrap_resamples=200)
    paths = make_report(sqlite_uri, "fp8rl", "edited", tmp_path / "now", parent, config=cfg, cell_ids=cell_ids)
    assert paths.statuses == {"FINISHED": 18} and paths.verdicts["stale_runs"] == 6
    truth = check_claims(current, cfg)
    assert [c.ci for r in paths.results for c in r.comparisons] == [c.ci for r in truth for c in r.comparisons]
    report = paths.report.read_text()
    assert "18 child runs (18 FINISHED)" in report
    assert "6 more child runs of this parent were left out as belonging to an earlier version of the sweep " \
           "file" in report
    summary = report.split("## Summary")[1].split("## Mismatch per run")[0]
    assert "| bf16 | none | 3 |" in summary  # not 6: the stale bf16 cells are not pooled in
    # without the current cells every child run counts, the stale ones mixed into the claims (the old behaviour)
    everything = make_report(sqlite_uri, "fp8rl", "edited", tmp_path / "all", parent, config=cfg, log_artifacts=False)
    assert everything.statuses == {"FINISHED": 24} and everything.verdicts["stale_runs"] == 0
    assert "left out" not in everything.report.read_text()
    assert [c.ci for r in everything.results for c in r.comparisons] != [c.ci for r in truth for c in r.comparisons]
    with pytest.raises(ValueError, match=r"no child runs yet \(24 of an earlier version of the sweep file left out\)"):
        make_report(sqlite_uri, "fp8rl", "edited", tmp_path / "none", parent, cell_ids=["not-a-cell"])


def test_report_with_matched_kernels_and_the_bf16_evaluation_engine(sqlite_uri, tmp_path):
    runs = synthetic_runs(seeds=3, steps=11, matched=("bf16", "fp8_gen", "fp8_e2e"), bf16_eval=True)
    log_sweep(sqlite_uri, "fp8rl", "study", runs)
    cfg = AnalysisConfig(bootstrap_resamples=200, accuracy_metric="val_accuracy_bf16_eval")
    paths = make_report(sqlite_uri, "fp8rl", "study", tmp_path, config=cfg, log_artifacts=False)
    assert paths.statuses == {"FINISHED": 27}
    truth = check_claims([r for r in runs if not r.tags["cell_id"].endswith("-matched")], cfg)
    assert [(r.status, r.metric) for r in paths.results] == [(r.status, r.metric) for r in truth]
    assert paths.results[3].metric == "val_accuracy_bf16_eval" and paths.results[3].deciding
    assert [(r.number, r.metric, r.deciding) for r in paths.aside] == [(3, "val_accuracy", False),
                                                                        (4, "val_accuracy", False)]
    report = paths.report.read_text()
    assert "9 of them ran with matched kernels" in report
    floor = report.split("### Zero-mismatch floor (matched kernels)")[1].split("## Figure 2")[0]
    assert "| bf16 | 3 | 1 exactly | 100% |" in floor and "| fp8_e2e | 3 | 1 exactly | 100% |" in floor
    assert "## Figure 2: validation accuracy (val_accuracy_bf16_eval) per recipe × IS" in report
    offset = report.split("## Evaluation engine: step-0 accuracy offset")[1].split("## Claims")[0]
    rows = {r["recipe"]: r for r in paths.verdicts["eval_offset"]}
    assert f"| fp8_gen | {rows['fp8_gen']['mean']:+.1f} |" in offset and rows["fp8_gen"]["n"] == 3
    assert rows["bf16"]["mean"] == 0.0 and rows["fp8_gen"]["ci"][0] < -3.0 < rows["fp8_gen"]["ci"][1]
    claims = report.split("## Claims")[1].split("## Summary")[0]
    assert "Not deciding: claims 3–4 on val_accuracy (analysis.accuracy_metric is val_accuracy_bf16_eval)." \
        in claims and "- Claim 4 on val_accuracy (not deciding):" in claims
    assert "3–4 on the final val_accuracy_bf16_eval" in claims
    summary = report.split("## Summary")[1].split("## Mismatch per run")[0]
    assert summary.count("| bf16 |") == 2 and "| bf16 | none | 3 |" in summary  # distinct cells only
    assert "IQM final val accuracy, BF16 eval engine (%)" in report
    js = json.loads(paths.claims_json.read_text())
    assert [c["number"] for c in js["claims"]] == [1, 2, 3, 4] and len(js["not_deciding"]) == 2
    assert js["not_deciding"][0]["deciding"] is False and js["missing_metrics"] == []
    assert {r["recipe"]: r["exact_fraction"] for r in js["floor"]} == {"bf16": 1.0, "fp8_gen": 0.0, "fp8_e2e": 1.0}
    assert "== not deciding: claims 3–4 on val_accuracy (analysis.accuracy_metric is val_accuracy_bf16_eval)" \
        in paths.verdicts_text
    assert paths.verdicts_text.startswith("Claims (4): ")


def test_report_of_runs_without_bf16_eval_says_it_is_missing(sweep_store, tmp_path):
    paths = make_report(sweep_store.uri, sweep_store.experiment, sweep_store.sweep, tmp_path, log_artifacts=False,
                        config=AnalysisConfig(bootstrap_resamples=200))
    assert paths.aside == [] and paths.verdicts["not_deciding"] == []
    assert paths.verdicts["missing_metrics"] == ["val_accuracy_bf16_eval"]
    assert all(r["missing"] for r in paths.verdicts["eval_offset"])
    report = paths.report.read_text()
    assert "val_accuracy_bf16_eval: missing (not logged by these runs)" in report
    assert "Claims 3–4 on val_accuracy_bf16_eval: not shown, val_accuracy_bf16_eval is missing" in report
    assert "No matched-kernel runs" in report
