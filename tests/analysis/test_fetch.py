"""fetch_sweep: child runs and full histories back out of a real MLflow store, in bulk."""
from __future__ import annotations

import numpy as np
import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

from analysis.fetch import fetch_sweep
from analysis.synthetic import log_sweep, synthetic_runs


def _check_against_truth(data, truth):
    by_id = {r.run_id: r for r in truth}
    assert sorted(r.run_id for r in data.runs) == sorted(by_id)
    for run in data.runs:
        expected = by_id[run.run_id]
        assert run.tags["recipe"] == expected.tags["recipe"] and run.tags["seed"] == expected.tags["seed"]
        assert set(run.metrics) == set(expected.metrics)
        for key, (steps, values) in expected.metrics.items():
            got_steps, got_values = run.series(key)
            np.testing.assert_array_equal(got_steps, steps)
            np.testing.assert_array_equal(got_values, values)  # float64 round-trips exactly


def test_fetch_by_sweep_name_and_by_parent(sweep_store):
    data = fetch_sweep(sweep_store.uri, sweep_store.experiment, sweep_name=sweep_store.sweep)
    assert data.parent_run_id == sweep_store.parent and len(data.runs) == 18
    _check_against_truth(data, sweep_store.runs)
    by_parent = fetch_sweep(sweep_store.uri, sweep_store.experiment, parent_run_id=sweep_store.parent)
    assert [r.run_id for r in by_parent.runs] == [r.run_id for r in data.runs]
    assert by_parent.sweep_name == sweep_store.sweep


def test_one_bulk_query_per_key_not_per_run(sweep_store, monkeypatch):
    calls = []
    real = SqlAlchemyStore.get_metric_history_bulk

    def spy(self, run_ids, metric_key, max_results):
        calls.append((len(run_ids), metric_key))
        return real(self, run_ids, metric_key, max_results)

    monkeypatch.setattr(SqlAlchemyStore, "get_metric_history_bulk", spy)
    data = fetch_sweep(sweep_store.uri, sweep_store.experiment, sweep_name=sweep_store.sweep,
                       keys=["token_mult_prob_error", "val_accuracy"])
    assert calls == [(18, "token_mult_prob_error"), (18, "val_accuracy")]
    assert set(data.runs[0].metrics) == {"token_mult_prob_error", "val_accuracy"}


def test_first_logged_value_wins_on_duplicate_steps(sqlite_uri):
    runs = synthetic_runs(recipes=("bf16",), is_variants=("none",), seeds=1, steps=3)
    log_sweep(sqlite_uri, "e", "dup", runs)
    run_id = runs[0].run_id
    MlflowClient(sqlite_uri).update_run(run_id, status="RUNNING")  # metrics can be logged again
    MlflowClient(sqlite_uri).log_batch(run_id, metrics=[Metric("loss", 123.0, 1_800_000_000_000, 1)], synchronous=True)
    data = fetch_sweep(sqlite_uri, "e", sweep_name="dup")
    steps, values = data.runs[0].series("loss")
    np.testing.assert_array_equal(steps, [0, 1, 2])
    assert values[1] == runs[0].metrics["loss"][1][1] != 123.0


def test_errors_name_the_problem(sweep_store):
    with pytest.raises(ValueError, match="sweep_name or parent_run_id"):
        fetch_sweep(sweep_store.uri, sweep_store.experiment)
    with pytest.raises(ValueError, match="experiment 'nope'"):
        fetch_sweep(sweep_store.uri, "nope", sweep_name="x")
    assert fetch_sweep(sweep_store.uri, sweep_store.experiment, sweep_name="no-such-sweep").runs == []


@pytest.mark.slow
@pytest.mark.mlflow_server
def test_fetch_over_http_equals_sql(sweep_store, tmp_path):
    from fp8rl_core.tracking.server import start_server

    with start_server(sweep_store.uri, log_path=tmp_path / "server.log") as server:
        data = fetch_sweep(server.url, sweep_store.experiment, sweep_name=sweep_store.sweep)
    _check_against_truth(data, sweep_store.runs)


def test_cell_ids_keep_the_current_cells_and_count_the_rest(sweep_store, monkeypatch):
    calls = []
    real = SqlAlchemyStore.get_metric_history_bulk

    def spy(self, run_ids, metric_key, max_results):
        calls.append(len(run_ids))
        return real(self, run_ids, metric_key, max_results)

    monkeypatch.setattr(SqlAlchemyStore, "get_metric_history_bulk", spy)
    current = [r for r in sweep_store.runs if r.tags["recipe"] != "fp8_e2e"]  # the file no longer has fp8_e2e
    data = fetch_sweep(sweep_store.uri, sweep_store.experiment, parent_run_id=sweep_store.parent,
                       keys=["val_accuracy"], cell_ids={r.tags["cell_id"] for r in current} | {"never-ran"})
    assert sorted(r.run_id for r in data.runs) == sorted(r.run_id for r in current) and data.stale_runs == 6
    assert calls == [12]  # the left-out runs' histories are not read
    assert fetch_sweep(sweep_store.uri, sweep_store.experiment, sweep_name=sweep_store.sweep).stale_runs == 0
