"""Driver-side run management: experiment, parent run, cell runs, states in one query, params."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from fp8rl_core.tracking import runs
from fp8rl_core.tracking.runs import (
    cell_states,
    create_parent_run,
    ensure_experiment,
    find_or_create_cell_run,
    finish_run,
    flatten_params,
    log_params,
    slurm_job_id,
)

REPO = Path(__file__).resolve().parents[3]


def test_experiment_is_created_once_with_artifacts_beside_the_db(sqlite_uri):
    exp = ensure_experiment(sqlite_uri, "fp8rl")
    assert ensure_experiment(sqlite_uri, "fp8rl") == exp
    e = MlflowClient(sqlite_uri).get_experiment(exp)
    db_dir = Path(sqlite_uri.removeprefix("sqlite:///")).parent
    assert e.artifact_location == (db_dir / "mlartifacts").as_uri()
    assert e.tags["mlflow.experimentKind"] == "custom_model_development"


def test_deleted_experiment_is_an_error(sqlite_uri):
    exp = ensure_experiment(sqlite_uri, "gone")
    MlflowClient(sqlite_uri).delete_experiment(exp)
    with pytest.raises(ValueError, match="deleted"):
        ensure_experiment(sqlite_uri, "gone")


def test_parent_run_is_idempotent_and_tagged(sqlite_uri):
    parent = create_parent_run(sqlite_uri, "fp8rl", "abl", params={"grid": {"recipe": ["bf16", "fp8_gen"]}},
                               config={"name": "abl", "seeds": [0, 1]})
    assert create_parent_run(sqlite_uri, "fp8rl", "abl") == parent
    run = MlflowClient(sqlite_uri).get_run(parent)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert run.data.tags["sweep"] == "abl" and run.data.tags["fp8rl.role"] == "sweep"
    assert run.data.tags["mlflow.source.git.commit"] == head and run.data.tags["host"]
    assert run.data.params == {"grid.recipe": '["bf16", "fp8_gen"]'}
    local = MlflowClient(sqlite_uri).download_artifacts(parent, "sweep.yaml")
    assert yaml.safe_load(Path(local).read_text()) == {"name": "abl", "seeds": [0, 1]}


def test_cell_runs_found_or_created(sqlite_uri):
    exp = ensure_experiment(sqlite_uri, "fp8rl")
    parent = create_parent_run(sqlite_uri, "fp8rl", "abl")
    cfg = {"recipe": "bf16", "loss": {"importance_sampling": "none"}, "seed": 0}
    tags = {"recipe": "bf16", "importance_sampling": "none", "seed": 0}
    run_id, status = find_or_create_cell_run(sqlite_uri, exp, parent, "c0ffee", tags, cfg, cfg)
    assert status == "SCHEDULED"
    assert find_or_create_cell_run(sqlite_uri, exp, parent, "c0ffee", tags, cfg, cfg) == (run_id, "SCHEDULED")
    run = MlflowClient(sqlite_uri).get_run(run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.data.tags["cell_id"] == "c0ffee"
    assert run.data.tags["sweep"] == "abl" and run.data.tags["seed"] == "0"
    assert run.info.run_name == "bf16-none-s0-c0ffee"
    assert run.data.params == {"recipe": "bf16", "loss.importance_sampling": "none", "seed": "0"}
    local = MlflowClient(sqlite_uri).download_artifacts(run_id, "config.yaml")
    assert yaml.safe_load(Path(local).read_text()) == cfg
    # the same cell id under another sweep's parent is another run
    other = create_parent_run(sqlite_uri, "fp8rl", "abl2")
    assert find_or_create_cell_run(sqlite_uri, exp, other, "c0ffee")[0] != run_id


def test_a_found_run_gets_the_params_a_killed_driver_left_out(sqlite_uri, monkeypatch):
    """The driver died after creating the run and before its params went in: the next driver logs them
    (the job never logs params of a sweep cell); params already there are not written twice."""
    import fp8rl_core.tracking.runs as tr

    exp = ensure_experiment(sqlite_uri, "fp8rl")
    parent = create_parent_run(sqlite_uri, "fp8rl", "abl")
    cfg = {"recipe": "bf16", "seed": 0, "warmstart": {"cache_dir": "/abs/ws"}}
    monkeypatch.setattr(tr, "log_params", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):  # the kill, between create_run and the params
        find_or_create_cell_run(sqlite_uri, exp, parent, "c0ffee", {"seed": 0}, cfg, cfg)
    monkeypatch.undo()
    run_id, _ = find_or_create_cell_run(sqlite_uri, exp, parent, "c0ffee", {"seed": 0}, cfg, cfg)
    assert MlflowClient(sqlite_uri).get_run(run_id).data.params == {
        "recipe": "bf16", "seed": "0", "warmstart.cache_dir": "/abs/ws"}
    calls = []
    monkeypatch.setattr(tr, "log_params", lambda *a, **k: calls.append(a))
    assert find_or_create_cell_run(sqlite_uri, exp, parent, "c0ffee", {"seed": 0}, cfg, cfg)[0] == run_id
    assert calls == []


def test_cell_states_use_one_search(sqlite_uri, monkeypatch):
    exp = ensure_experiment(sqlite_uri, "fp8rl")
    parent = create_parent_run(sqlite_uri, "fp8rl", "abl")
    ids = {f"cell{i}": find_or_create_cell_run(sqlite_uri, exp, parent, f"cell{i}")[0] for i in range(6)}
    finish_run(sqlite_uri, ids["cell0"], "FINISHED")
    finish_run(sqlite_uri, ids["cell1"], "FAILED")
    MlflowClient(sqlite_uri).update_run(ids["cell2"], status="RUNNING")
    MlflowClient(sqlite_uri).delete_run(ids["cell3"])  # deleted in the UI: runs again
    # a duplicate run of cell1 that finished (two drivers raced): the best status wins
    dup = MlflowClient(sqlite_uri).create_run(exp, tags={"mlflow.parentRunId": parent, "cell_id": "cell1",
                                                          "fp8rl.role": "cell", "sweep": "abl"}).info.run_id
    finish_run(sqlite_uri, dup, "FINISHED")
    calls = []
    real = MlflowClient.search_runs
    monkeypatch.setattr(MlflowClient, "search_runs", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
    states = cell_states(sqlite_uri, "fp8rl", "abl")
    assert len(calls) == 1
    assert states == {"cell0": "FINISHED", "cell1": "FINISHED", "cell2": "RUNNING", "cell4": "SCHEDULED",
                      "cell5": "SCHEDULED"}
    assert cell_states(sqlite_uri, "no-such-experiment", "abl") == {}


def test_flatten_params_respects_mlflow_limits():
    long_a, long_b = "a" * 300 + ".x", "a" * 300 + ".y"
    flat = flatten_params({long_a: 1, long_b: 2, "text": "z" * 7000, "nested": {"none": None, "list": [1, 2]}})
    assert all(len(k) <= 250 for k in flat) and len(flat) == 5  # two long keys stay distinct
    assert len(flat["text"]) == 6000 and flat["text"].endswith("[truncated]")
    assert flat["nested.none"] == "None" and flat["nested.list"] == "[1, 2]"


def test_params_logged_in_batches_of_100(sqlite_uri):
    client = MlflowClient(sqlite_uri)
    run_id = client.create_run(client.create_experiment("p")).info.run_id
    sizes, real = [], client.log_batch
    client.log_batch = lambda run_id, params=(), **k: sizes.append(len(params)) or real(run_id, params=params, **k)
    log_params(client, run_id, {f"k{i:03d}": i for i in range(250)})
    assert sizes == [100, 100, 50]
    assert len(MlflowClient(sqlite_uri).get_run(run_id).data.params) == 250


def test_slurm_job_id_from_env():
    assert slurm_job_id({}) is None
    assert slurm_job_id({"SLURM_JOB_ID": "42"}) == "42"
    assert slurm_job_id({"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3"}) == "40_3"


def test_context_tags_include_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    tags = runs.context_tags(git=False)
    assert tags["slurm_job_id"] == "77" and tags["host"] and "git_commit" not in tags


def test_quotes_in_names_are_refused(sqlite_uri):
    with pytest.raises(ValueError, match="sweep"):
        create_parent_run(sqlite_uri, "fp8rl", "it's")


def test_ending_a_killed_run_first_ships_what_its_buffer_holds(sqlite_uri, tmp_path):
    """A cell killed between two shipments: end_run(KILLED, buffer) puts every logged step in MLflow."""
    from fp8rl_core.tracking.mlflow_sink import MlflowSink
    from fp8rl_core.tracking.runs import end_run

    exp = ensure_experiment(sqlite_uri, "fp8rl")
    parent = create_parent_run(sqlite_uri, "fp8rl", "sw")
    run_id, _ = find_or_create_cell_run(sqlite_uri, exp, parent, "c1")
    buffer = tmp_path / "metrics.jsonl"
    sink = MlflowSink(sqlite_uri, run_id, buffer, background=False)
    for step in (1, 2):
        sink.log(step, {"loss": 1.0 / step})
    assert sink.flush(10.0)  # the first shipment
    for step in (3, 4, 5):
        sink.log(step, {"loss": 1.0 / step})
    del sink  # SIGKILL: no close, steps 3-5 only in the buffer
    client = MlflowClient(sqlite_uri)
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2]
    assert end_run(sqlite_uri, run_id, "KILLED", buffer_path=buffer)
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == [1, 2, 3, 4, 5]
    assert client.get_run(run_id).info.status == "KILLED"
    assert not end_run(sqlite_uri, run_id, "FAILED", buffer_path=buffer)  # an ended run stays as it is
    assert client.get_run(run_id).info.status == "KILLED"


def test_end_run_ships_nothing_of_another_runs_buffer(sqlite_uri, tmp_path):
    from fp8rl_core.tracking.mlflow_sink import MlflowSink
    from fp8rl_core.tracking.runs import end_run

    exp = ensure_experiment(sqlite_uri, "fp8rl")
    parent = create_parent_run(sqlite_uri, "fp8rl", "sw")
    a, _ = find_or_create_cell_run(sqlite_uri, exp, parent, "a")
    b, _ = find_or_create_cell_run(sqlite_uri, exp, parent, "b")
    sink = MlflowSink(sqlite_uri, a, tmp_path / "m.jsonl", background=False)
    sink.log(1, {"loss": 1.0})
    sink.close("FINISHED")
    assert end_run(sqlite_uri, b, "KILLED", buffer_path=tmp_path / "m.jsonl")
    assert MlflowClient(sqlite_uri).get_metric_history(b, "loss") == []
