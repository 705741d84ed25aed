"""make_report: everything regenerated from MLflow and logged to the sweep's parent run."""
from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from analysis.claims import check_claims
from analysis.config import AnalysisConfig
from analysis.report import ARTIFACT_DIR, CLAIM_TAG, make_report, ui_link
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
