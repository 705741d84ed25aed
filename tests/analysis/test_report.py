"""make_report: everything regenerated from MLflow and logged to the sweep's parent run."""
from __future__ import annotations

import pytest
from mlflow import MlflowClient

from analysis.report import ARTIFACT_DIR, make_report
from analysis.synthetic import log_sweep, synthetic_runs


def test_report_files_and_parent_artifacts(sweep_store, tmp_path):
    paths = make_report(sweep_store.uri, sweep_store.experiment, sweep_store.sweep, tmp_path / "report")
    assert paths.logged_to == sweep_store.parent and paths.statuses == {"FINISHED": 18}
    names = sorted(p.name for p in paths.files())
    assert names == sorted(["report.md", "fig1_token_mult_prob_error.png", "fig1_token_mult_prob_error.svg",
                            "fig2_val_accuracy.png", "fig2_val_accuracy.svg", "summary.md", "summary.csv", "claims.md"])
    assert all(p.exists() and p.stat().st_size > 100 for p in paths.files())
    logged = {f.path for f in MlflowClient(sweep_store.uri).list_artifacts(sweep_store.parent, ARTIFACT_DIR)}
    assert logged == {f"{ARTIFACT_DIR}/{n}" for n in names}
    report = paths.report.read_text()
    assert "18 child runs (18 FINISHED)" in report and "](fig1_token_mult_prob_error.png)" in report
    assert report.count("| bf16 |") == 2 and "| 4 |" in report  # the table's bf16 rows; claim 4
    claims = paths.claims.read_text()
    assert all(f"| {i} |" in claims for i in range(1, 5))


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
