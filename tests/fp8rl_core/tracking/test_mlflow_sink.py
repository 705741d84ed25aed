"""MlflowSink: buffer first, ship in log_batch calls, survive an unreachable server, never duplicate."""
from __future__ import annotations

import json
import time

import pytest
from mlflow import MlflowClient

from fp8rl_core.io.ports import free_port
from fp8rl_core.tracking.mlflow_sink import MAX_METRICS, MlflowSink, replay_buffer


def _new_run(uri: str) -> str:
    client = MlflowClient(uri)
    exp = client.create_experiment("t")
    return client.create_run(exp).info.run_id


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def _spy_batches(sink: MlflowSink) -> list[int]:
    sizes, real = [], sink.client.log_batch

    def log_batch(run_id, metrics=(), params=(), tags=(), synchronous=None):
        sizes.append(len(metrics))
        return real(run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous)

    sink.client.log_batch = log_batch
    return sizes


def test_ships_everything_in_batches(sqlite_uri, tmp_path):
    run_id = _new_run(sqlite_uri)
    sink = MlflowSink(sqlite_uri, run_id, tmp_path / "m.jsonl", background=False)
    sizes = _spy_batches(sink)
    keys = ("loss", "reward_mean", "is_weight_mean")
    expected = {k: [(s, 0.5 * s + i) for s in range(500)] for i, k in enumerate(keys)}
    for step in range(500):
        sink.log(step, {k: v[step][1] for k, v in expected.items()})
    sink.log_params({"optim": {"lr": 2e-4}, "seed": 3})
    assert MlflowClient(sqlite_uri).get_run(run_id).info.status == "RUNNING"  # not shipped yet
    assert sink.close("FINISHED")
    for key, values in expected.items():
        assert _history(sqlite_uri, run_id, key) == values
    assert sum(sizes) == 1500 and max(sizes) <= MAX_METRICS and len([s for s in sizes if s]) == 2
    run = MlflowClient(sqlite_uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"optim.lr": "0.0002", "seed": "3"}
    assert run.data.tags["host"]


def test_unreachable_server_loses_nothing(sqlite_uri, tmp_path, caplog):
    run_id = _new_run(sqlite_uri)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    buf = tmp_path / "m.jsonl"
    sink = MlflowSink(dead, run_id, buf, background=False, close_timeout_s=0.3, initial_backoff_s=0.05)
    for step in range(50):
        sink.log(step, {"loss": float(step)})
    assert not sink.flush()
    t0 = time.monotonic()
    assert not sink.close("FINISHED")
    assert time.monotonic() - t0 < 10  # the /health probe fails fast; no minutes of HTTP retries
    assert sink.failures >= 1 and "unreachable" in caplog.text
    assert _history(sqlite_uri, run_id, "loss") == []
    # the tracking store is back (here: the same run, reached directly): replay ships the buffer
    assert replay_buffer(sqlite_uri, run_id, buf)
    assert _history(sqlite_uri, run_id, "loss") == [(s, float(s)) for s in range(50)]
    assert MlflowClient(sqlite_uri).get_run(run_id).info.status == "FINISHED"
    assert replay_buffer(sqlite_uri, run_id, buf)  # a second replay adds nothing
    assert len(_history(sqlite_uri, run_id, "loss")) == 50


def test_requeued_run_continues_without_duplicates(sqlite_uri, tmp_path):
    run_id = _new_run(sqlite_uri)
    buf = tmp_path / "m.jsonl"
    sink = MlflowSink(sqlite_uri, run_id, buf, background=False)
    for step in range(10):
        sink.log(step, {"loss": float(step)})
    assert sink.close(None)  # preempted: stays RUNNING
    assert MlflowClient(sqlite_uri).get_run(run_id).info.status == "RUNNING"
    sink = MlflowSink(sqlite_uri, run_id, buf, background=False)  # requeued; checkpoint was at step 6
    for step in range(7, 15):
        sink.log(step, {"loss": 100.0 + step})
    assert sink.dropped == 3
    assert sink.close("FINISHED")
    first = [(s, float(s)) for s in range(10)]
    assert _history(sqlite_uri, run_id, "loss") == first + [(s, 100.0 + s) for s in range(10, 15)]


def test_lost_offset_replays_without_duplicates(sqlite_uri, tmp_path):
    """A kill between MLflow's ack and the offset write: the re-shipped records are exact duplicates
    (same key, step, timestamp, value), which MLflow's SQL store drops."""
    run_id = _new_run(sqlite_uri)
    buf = tmp_path / "m.jsonl"
    sink = MlflowSink(sqlite_uri, run_id, buf, background=False)
    for step in range(20):
        sink.log(step, {"loss": float(step), "reward_mean": 0.5})
    assert sink.close(None)
    (tmp_path / "m.jsonl.shipped.json").write_text(json.dumps({"run_id": run_id, "offset": 0}))
    assert replay_buffer(sqlite_uri, run_id, buf)
    assert _history(sqlite_uri, run_id, "loss") == [(s, float(s)) for s in range(20)]
    assert len(_history(sqlite_uri, run_id, "reward_mean")) == 20


def test_empty_buffer_starts_after_mlflow_last_step(sqlite_uri, tmp_path):
    run_id = _new_run(sqlite_uri)
    first = MlflowSink(sqlite_uri, run_id, tmp_path / "a.jsonl", background=False)
    for step in range(10):
        first.log(step, {"loss": float(step)})
    first.close(None)
    # requeued on a node without the old output dir: the buffer is new, MLflow knows steps 0..9
    second = MlflowSink(sqlite_uri, run_id, tmp_path / "b.jsonl", background=False)
    for step in range(5, 15):
        second.log(step, {"loss": -1.0})
    assert second.close("FINISHED")
    assert [s for s, _ in _history(sqlite_uri, run_id, "loss")] == list(range(15))


def test_rejected_record_does_not_block_others(sqlite_uri, tmp_path, caplog):
    run_id = _new_run(sqlite_uri)
    sink = MlflowSink(sqlite_uri, run_id, tmp_path / "m.jsonl", background=False)
    sink.log_params({"lr": 1})
    assert sink.flush()
    sink.log_params({"lr": 2})  # MLflow refuses to change a logged param
    sink.log(0, {"loss": 1.0})
    assert sink.close("FINISHED")
    assert sink.rejected == 1 and "rejected" in caplog.text
    assert _history(sqlite_uri, run_id, "loss") == [(0, 1.0)]
    assert MlflowClient(sqlite_uri).get_run(run_id).data.params["lr"] == "1"


def test_background_thread_ships(sqlite_uri, tmp_path):
    run_id = _new_run(sqlite_uri)
    sink = MlflowSink(sqlite_uri, run_id, tmp_path / "m.jsonl", flush_interval_s=0.05)
    for step in range(5):
        sink.log(step, {"loss": float(step)})
    deadline = time.monotonic() + 10
    while len(_history(sqlite_uri, run_id, "loss")) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_history(sqlite_uri, run_id, "loss")) == 5  # without flush() or close()
    assert sink.close("KILLED")
    assert MlflowClient(sqlite_uri).get_run(run_id).info.status == "KILLED"


def test_buffer_of_another_run_is_refused(sqlite_uri, tmp_path):
    run_id = _new_run(sqlite_uri)
    sink = MlflowSink(sqlite_uri, run_id, tmp_path / "m.jsonl", background=False)
    sink.log(0, {"loss": 1.0})
    sink.close(None)
    with pytest.raises(ValueError, match="belongs to MLflow run"):
        MlflowSink(sqlite_uri, "f" * 32, tmp_path / "m.jsonl", background=False)


def test_oversized_record_is_split_within_limits(sqlite_uri, tmp_path):
    run_id = _new_run(sqlite_uri)
    sink = MlflowSink(sqlite_uri, run_id, tmp_path / "m.jsonl", background=False)
    calls, real = [], sink.client.log_batch

    def log_batch(run_id, metrics=(), params=(), tags=(), synchronous=None):
        calls.append((len(metrics), len(params), len(tags)))
        return real(run_id, metrics=metrics, params=params, tags=tags, synchronous=synchronous)

    sink.client.log_batch = log_batch
    sink.log_params({f"p{i}": i for i in range(150)})
    sink.set_tags({f"t{i}": i for i in range(120)})
    sink.log(0, {f"m{i}": float(i) for i in range(2100)})
    assert sink.close("FINISHED")
    assert all(m <= 1000 and p <= 100 and t <= 100 and m + p + t <= 1000 for m, p, t in calls)
    assert sum(c[0] for c in calls) == 2100 and sum(c[1] for c in calls) == 150
    run = MlflowClient(sqlite_uri).get_run(run_id)
    assert len(run.data.params) == 150 and len(run.data.metrics) == 2100 and run.data.tags["t119"] == "119"
