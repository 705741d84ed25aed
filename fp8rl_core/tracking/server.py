"""Start and stop an `mlflow server` (tracking + artifact proxy) for jobs that log over HTTP.

    with start_server("sqlite:////shared/sweep/mlflow.db") as server:   # 127.0.0.1, a free port
        print(server.url)        # http://127.0.0.1:PORT: the sweep's tracking URI
        ...                      # server.stop() at the end of the block

The process runs `python -m mlflow server` (an argument list, never a shell string) in its own
process group, so that `stop()` also ends its uvicorn/gunicorn workers. It binds to 127.0.0.1
unless `host` says otherwise; another address exposes an unauthenticated server, so it is logged
as a warning, and clients that use the machine's name need `--allowed-hosts` in `extra_args`.
Artifacts are proxied by the server (`--artifacts-destination`, default `<db dir>/mlartifacts`
for SQLite), so jobs on other nodes need no shared artifact directory. Health: GET `/health`
(about 20 s after start on our 2-core machine).
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fp8rl_core.io.ports import free_port
from fp8rl_core.tracking.store import default_artifact_location, health_ok, sqlite_path

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def server_command(backend_store_uri: str, artifacts_destination: str | None = None, host: str = "127.0.0.1",
                   port: int = 5000, workers: int = 1, extra_args: Sequence[str] = ()) -> list[str]:
    """The argument list of `mlflow server` (what `sweep server` runs and documents)."""
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_store_uri,
           "--host", host, "--port", str(port), "--workers", str(workers)]
    dest = artifacts_destination or default_artifact_location(backend_store_uri)
    if dest:
        cmd += ["--serve-artifacts", "--artifacts-destination", dest]
    return cmd + list(extra_args)


@dataclass
class MlflowServer:
    """A running `mlflow server`: `url` is the tracking URI to give jobs."""

    url: str
    process: subprocess.Popen
    log_path: Path

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group (the workers too), SIGKILL after `timeout_s`."""
        if not self.running():
            return
        pgid = os.getpgid(self.process.pid)  # its own group: start_new_session=True below
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.process.wait(5)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> MlflowServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_healthy(server: MlflowServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.running():
            raise RuntimeError(f"mlflow server exited with code {server.process.returncode}; "
                               f"log {server.log_path}:\n{server.log_tail()}")
        if health_ok(server.url, timeout_s=1.0):
            return
        time.sleep(0.25)
    server.stop()
    raise TimeoutError(f"mlflow server at {server.url} not healthy after {timeout_s:.0f} s; "
                       f"log {server.log_path}:\n{server.log_tail()}")


def start_server(backend_store_uri: str, artifacts_destination: str | None = None, host: str = "127.0.0.1",
                 port: int | None = None, workers: int = 1, timeout_s: float = 90.0,
                 log_path: str | Path | None = None, extra_args: Sequence[str] = ()) -> MlflowServer:
    """Start `mlflow server` and return once `/health` answers (raises with the log tail if not)."""
    if host not in LOOPBACK:
        log.warning("mlflow server binds to %s: anyone who can reach this address can read and write runs", host)
    port = port or free_port(host if host != "localhost" else "127.0.0.1")
    if log_path is None:
        db = sqlite_path(backend_store_uri) or Path.cwd() / "x"
        log_path = db.parent / f"mlflow-server-{port}.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = server_command(backend_store_uri, artifacts_destination, host, port, workers, extra_args)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    url_host = f"[{host}]" if ":" in host else host
    server = MlflowServer(f"http://{url_host}:{port}", proc, log_path)
    wait_healthy(server, timeout_s)
    return server
