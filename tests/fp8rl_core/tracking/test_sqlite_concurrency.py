"""Several local jobs logging into one SQLite file at once: nothing lost, nothing duplicated.

MLflow sets `PRAGMA busy_timeout = 20000` on its SQLite sessions, so writers wait for each other; a
lock that outlasts it surfaces as MlflowException TEMPORARILY_UNAVAILABLE ("database is locked"),
which MlflowSink retries with backoff (checked here with an injected failure, and for real with 4
processes). Measured numbers: benchmarks/mlflow_logging.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from fp8rl_core.tracking.mlflow_sink import MlflowSink

REPO = Path(__file__).resolve().parents[3]
KEYS = ("token_mult_prob_error", "reward_mean", "val_accuracy", "is_weight_mean", "loss", "step_time_s")

WORKER = """
import json, sys
from fp8rl_core.tracking.mlflow_sink import MlflowSink
uri, run_id, buf, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
keys = json.loads(sys.argv[5])
sink = MlflowSink(uri, run_id, buf, background=False, initial_backoff_s=0.05, max_backoff_s=2.0)
for s in range(steps):
    sink.log(s, {k: s + i / 10 for i, k in enumerate(keys)})
    sink.flush()  # worst case: one transaction per step per process
print(json.dumps({"ok": sink.close("FINISHED"), "retries": sink.failures}))
"""


def test_database_locked_is_retried(sqlite_uri, tmp_path):
    client = MlflowClient(sqlite_uri)
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    sink = MlflowSink(sqlite_uri, run_id, tmp_path / "m.jsonl", background=False, initial_backoff_s=0.01)
    real, failures = sink.client.log_batch, [2]

    def flaky(*args, **kwargs):
        if failures[0]:
            failures[0] -= 1
            # error_code 2: TEMPORARILY_UNAVAILABLE
            raise MlflowException("(sqlite3.OperationalError) database is locked", error_code=2)
        return real(*args, **kwargs)

    sink.client.log_batch = flaky
    sink.log(0, {"loss": 1.0})
    assert not sink.flush()  # first attempt fails: kept, retried later
    assert sink.flush(timeout_s=5)
    assert sink.failures == 2 and sink.close("FINISHED")
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "loss")] == [(0, 1.0)]


@pytest.mark.slow
def test_four_processes_one_sqlite_file(sqlite_uri, tmp_path):
    client = MlflowClient(sqlite_uri)
    exp = client.create_experiment("conc")
    run_ids = [client.create_run(exp).info.run_id for _ in range(4)]
    steps = 40
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, sqlite_uri, r, str(tmp_path / f"b{i}.jsonl"), str(steps),
                               json.dumps(KEYS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=REPO) for i, r in enumerate(run_ids)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["ok"] for r in results)
    for run_id in run_ids:
        for i, key in enumerate(KEYS):
            history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
            assert history == [(s, s + i / 10) for s in range(steps)]
        assert client.get_run(run_id).info.status == "FINISHED"
