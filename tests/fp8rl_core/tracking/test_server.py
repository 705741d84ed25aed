"""A real `mlflow server` on loopback: jobs log over HTTP; the server goes down and comes back."""
from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from fp8rl_core.tracking.mlflow_sink import MlflowSink
from fp8rl_core.tracking.runs import cell_states, create_parent_run, ensure_experiment, find_or_create_cell_run
from fp8rl_core.tracking.server import health_ok, server_command, start_server

pytestmark = [pytest.mark.slow, pytest.mark.mlflow_server]


def test_server_command_is_an_argument_list_on_loopback():
    cmd = server_command("sqlite:////data/x y/mlflow.db", port=5001)
    assert cmd[1:4] == ["-m", "mlflow", "server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--backend-store-uri") + 1] == "sqlite:////data/x y/mlflow.db"  # one argument, spaces kept
    assert cmd[cmd.index("--artifacts-destination") + 1] == Path("/data/x y/mlartifacts").as_uri()


def test_log_over_http_through_an_outage(sqlite_uri, tmp_path):
    db_uri = sqlite_uri
    server = start_server(db_uri, log_path=tmp_path / "server.log")
    port = int(server.url.rsplit(":", 1)[1])
    try:
        assert server.url.startswith("http://127.0.0.1:") and health_ok(server.url)
        exp = ensure_experiment(server.url, "fp8rl")
        parent = create_parent_run(server.url, "fp8rl", "http-sweep")
        run_id, status = find_or_create_cell_run(server.url, exp, parent, "cell-a", {"recipe": "bf16"})
        assert status == "SCHEDULED"
        sink = MlflowSink(server.url, run_id, tmp_path / "m.jsonl", background=False, initial_backoff_s=0.05)
        for step in range(10):
            sink.log(step, {"loss": float(step)})
        assert sink.flush()
    finally:
        server.stop()
    assert not server.running() and not health_ok(server.url)
    for step in range(10, 20):  # the server is down: the job goes on, records wait in the buffer
        sink.log(step, {"loss": float(step)})
    (tmp_path / "fig.txt").write_text("a figure")
    sink.log_artifact(tmp_path / "fig.txt", "figures")
    assert not sink.flush()
    server = start_server(db_uri, port=port, log_path=tmp_path / "server2.log")
    try:
        assert sink.close("FINISHED")
        client = MlflowClient(server.url)
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "loss"))
        assert history == [(s, float(s)) for s in range(20)]
        assert client.get_run(run_id).info.status == "FINISHED"
        assert Path(client.download_artifacts(run_id, "figures/fig.txt", str(tmp_path))).read_text() == "a figure"
        assert cell_states(server.url, "fp8rl", "http-sweep") == {"cell-a": "FINISHED"}
    finally:
        server.stop()
