"""Low-level MLflow store helpers every tracking module shares (no run lifecycle here: see `runs.py`).

- URIs: `sqlite_path(uri)` is the ONE parser of `sqlite:///` URIs (relative and absolute paths),
  `absolute_uri(uri, cwd)` anchors a relative one, `store_exists(uri)` looks without creating;
- reachability: `health_ok(url)`, `tracking_reachable(uri)`, `TrackingUnreachable`;
- SQLite's "database is locked" under many writers: `retry_locked(fn, ...)`;
- what a run records: `flatten_params` (MLflow's key/value limits), `context_tags` (host, user, git, SLURM);
- `set_status(store, run_id, status)`: the one place a run's status is written (runs.py and the sink call it);
- `Store(uri)`: the one door to MLflow's client. Every MLflow call of the project (tracking, the
  sweep engine, analysis, scripts, benchmarks) goes through its named methods, so a change of
  MLflow's client API (we pin a range and use private parts: bulk metric histories) is one place to
  adapt. Tests may use `MlflowClient` directly.
"""
from __future__ import annotations

import getpass
import hashlib
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fp8rl_core.config.schema import flatten
from fp8rl_core.tracking.contract import END_STATUSES, OPEN_STATUSES, RUNNING  # noqa: F401  (OPEN_STATUSES: API)

if TYPE_CHECKING:  # pragma: no cover
    from mlflow.entities import Experiment, Metric, Param, Run, RunTag

T = TypeVar("T")
SQLITE = "sqlite:///"  # MLflow is imported by the functions that call it: URI helpers stay cheap
MAX_KEY_LEN = 250
MAX_PARAM_VALUE_LEN = 6000
MAX_TAG_VALUE_LEN = 8000
MAX_PARAMS_PER_BATCH = 100
PAGE = 50000  # runs per search page: further pages only past that many runs
_REPO_ROOT = Path(__file__).resolve().parents[2]


def sqlite_path(uri: str) -> Path | None:
    """`sqlite:///rel/mlflow.db` -> Path('rel/mlflow.db'), `sqlite:////abs/x.db` -> Path('/abs/x.db'),
    anything else -> None."""
    return Path(uri[len(SQLITE):]) if uri.startswith(SQLITE) else None


def absolute_uri(uri: str, cwd: Path) -> str:
    """A relative sqlite path made absolute against `cwd` (jobs may run in another folder); others as given."""
    path = sqlite_path(uri)
    return f"{SQLITE}{Path(cwd) / path}" if path is not None and not path.is_absolute() else uri


def store_exists(uri: str) -> bool:
    """False for a SQLite store without MLflow's tables yet (opening it would create them; status and
    plan only read). Checked with SQLite itself, read-only. Other stores: True."""
    path = sqlite_path(uri)
    if path is None:
        return True
    if not path.exists():
        return False
    import sqlite3

    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10)
        try:
            return con.execute("SELECT 1 FROM sqlite_master WHERE name = 'experiments'").fetchone() is not None
        finally:
            con.close()
    except sqlite3.Error:
        return False


def health_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class TrackingUnreachable(RuntimeError):
    """The MLflow tracking server does not answer."""


def tracking_reachable(uri: str, timeout_s: float = 3.0) -> bool:
    """False when an http(s) tracking server does not answer /health (MLflow's own client would
    retry for minutes); other stores are assumed reachable."""
    if not uri.startswith(("http://", "https://")):
        return True
    return health_ok(uri, timeout_s)


def retry_locked(fn: Callable[..., T], *args: Any, tries: int = 20, **kwargs: Any) -> T:
    """Call fn, retrying while SQLite says "database is locked" (jobs write the same file)."""
    delay = 0.1
    for i in range(tries):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # MlflowException wraps sqlalchemy's OperationalError
            if "database is locked" not in str(e) or i == tries - 1:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
    raise AssertionError("unreachable")


def set_status(client: Store, run_id: str, status: str, end_time: int | None = None) -> None:
    """Write a run's status: RUNNING (started, or requeued) or FINISHED/FAILED/KILLED (ended)."""
    if status == RUNNING:
        client.update_run(run_id, status=RUNNING)
    elif status in END_STATUSES:
        client.set_terminated(run_id, status, end_time=end_time)
    else:
        raise ValueError(f"status: {status!r} not allowed; valid: RUNNING, {', '.join(END_STATUSES)}")


def default_artifact_location(uri: str) -> str | None:
    """`sqlite:///dir/mlflow.db` -> `file:///dir/mlartifacts` (artifacts beside the database, not
    in MLflow's cwd-relative `./mlruns`); None for other stores (the server decides)."""
    db = sqlite_path(uri)
    return None if db is None else (db.resolve().parent / "mlartifacts").as_uri()


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_REPO_ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """`<array job>_<task>` for an array task, else `SLURM_JOB_ID`, else None."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def context_tags(git: bool = True) -> dict[str, str]:
    """Where and from what code this process runs: host, user, git commit, SLURM job id."""
    tags = {"host": socket.gethostname()}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry inside some containers
        pass
    if git:
        commit = _git("rev-parse", "HEAD")
        if commit:
            tags["mlflow.source.git.commit"] = tags["git_commit"] = commit
            tags["git_dirty"] = str(bool(_git("status", "--porcelain", "--untracked-files=no")))
    job = slurm_job_id()
    if job:
        tags["slurm_job_id"] = job
    return tags


def _param_text(value: Any) -> str:
    if isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, default=str) if isinstance(value, (list, tuple)) else str(value)
    if len(text) > MAX_PARAM_VALUE_LEN:
        mark = "...[truncated]"
        text = text[: MAX_PARAM_VALUE_LEN - len(mark)] + mark
    return text


def _param_key(key: str) -> str:
    if len(key) <= MAX_KEY_LEN:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]  # keeps two long keys apart
    return f"{key[: MAX_KEY_LEN - 9]}~{digest}"


def flatten_params(config: Mapping[str, Any]) -> dict[str, str]:
    """Nested config -> `{"a.b": "value"}` within MLflow's limits (lists as JSON, None as 'None')."""
    return {_param_key(k): _param_text(v) for k, v in flatten(dict(config)).items()}


def mlflow_error() -> type[Exception]:
    """MLflow's exception class, imported on first use (this module is MLflow's one home in the package)."""
    from mlflow.exceptions import MlflowException

    return MlflowException


def entity_types() -> tuple[type[Metric], type[Param], type[RunTag]]:
    """MLflow's `Metric`, `Param` and `RunTag` entities, imported on first use."""
    from mlflow.entities import Metric, Param, RunTag

    return Metric, Param, RunTag


def log_params(client: Store, run_id: str, params: Mapping[str, Any]) -> None:
    """Flatten and log `params` in batches of <= 100 (MLflow's per-request limit)."""
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in flatten_params(params).items()]
    for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i : i + MAX_PARAMS_PER_BATCH], synchronous=True)


def set_tags(client: Store, run_id: str, tags: Mapping[str, Any]) -> None:
    from mlflow.entities import RunTag

    items = [RunTag(k, str(v)[:MAX_TAG_VALUE_LEN]) for k, v in tags.items()]
    for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=items[i : i + MAX_PARAMS_PER_BATCH], synchronous=True)


def log_config_artifact(client: Store, run_id: str, config: Mapping[str, Any],
                        name: str = "config.yaml") -> None:
    """The full (untruncated) config as a YAML artifact at the run's artifact root."""
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        client.log_artifact(run_id, str(path))


Points = list[tuple[int, int, float]]  # a metric's history: (step, timestamp_ms, value)
REST_BULK = "/api/2.0/mlflow/metrics/get-history-bulk-interval"
REST_MAX_RUNS, REST_MAX_POINTS = 100, 2500  # the server's limits for that endpoint
SQL_CHUNK = 500  # run ids per SQL `IN (...)`


class Store:
    """The MLflow tracking store at `uri`, through the calls this project makes (named as MLflow's
    client names them). Searches return every active run that matches (paged), never a first page."""

    def __init__(self, uri: str):
        from mlflow import MlflowClient

        self.uri = uri
        self._client = MlflowClient(uri)

    # ---- experiments ------------------------------------------------------------------------------
    def get_experiment_by_name(self, name: str) -> Experiment | None:
        return self._client.get_experiment_by_name(name)

    def experiment_id(self, name: str) -> str | None:
        exp = self._client.get_experiment_by_name(name)
        return exp.experiment_id if exp is not None else None

    def create_experiment(self, name: str, artifact_location: str | None = None,
                          tags: Mapping[str, str] | None = None) -> str:
        return self._client.create_experiment(name, artifact_location, dict(tags or {}))

    def create_tables(self) -> None:
        """Make a new SQLite store's schema now (the first call creates it: seconds, not in a timing)."""
        self._client.search_experiments()

    # ---- runs -----------------------------------------------------------------------------------------
    def search_runs(self, experiment_ids: list[str], filter_string: str = "", order_by: list[str] | None = None,
                    max_results: int | None = None) -> list[Run]:
        """Every active run matching the filter (one query; further pages only past PAGE runs), or
        the first `max_results`."""
        from mlflow.entities import ViewType

        runs: list[Run] = []
        token = None
        while True:
            page = self._client.search_runs(experiment_ids, filter_string, ViewType.ACTIVE_ONLY,
                                            max_results or PAGE, order_by, token)
            runs.extend(page)
            token = page.token
            if not token or (max_results and len(runs) >= max_results):
                return runs

    def get_run(self, run_id: str) -> Run:
        return self._client.get_run(run_id)

    def create_run(self, experiment_id: str, run_name: str | None = None,
                   tags: Mapping[str, str] | None = None) -> Run:
        return self._client.create_run(experiment_id, run_name=run_name, tags=dict(tags or {}))

    def update_run(self, run_id: str, status: str) -> None:
        self._client.update_run(run_id, status=status)

    def set_terminated(self, run_id: str, status: str, end_time: int | None = None) -> None:
        self._client.set_terminated(run_id, status, end_time=end_time)

    def set_tag(self, run_id: str, key: str, value: Any) -> None:
        self._client.set_tag(run_id, key, value)

    def log_metric(self, run_id: str, key: str, value: float, timestamp: int | None = None,
                   step: int | None = None, synchronous: bool = True) -> None:
        self._client.log_metric(run_id, key, value, timestamp, step, synchronous=synchronous)

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = (),
                  synchronous: bool = True) -> None:
        self._client.log_batch(run_id, metrics=list(metrics), params=list(params), tags=list(tags),
                               synchronous=synchronous)

    def log_metric_points(self, run_id: str, points: Any, chunk: int = 1000) -> None:
        """Log (key, value, timestamp_ms, step) tuples in log_batch calls of at most `chunk` metrics."""
        from mlflow.entities import Metric

        metrics = [Metric(k, float(v), int(ts), int(s)) for k, v, ts, s in points]
        for i in range(0, len(metrics), chunk):
            self._client.log_batch(run_id, metrics=metrics[i : i + chunk], synchronous=True)

    def log_artifact(self, run_id: str, path: str, artifact_path: str | None = None) -> None:
        self._client.log_artifact(run_id, path, artifact_path)

    def log_artifacts(self, run_id: str, folder: str, artifact_path: str | None = None) -> None:
        self._client.log_artifacts(run_id, folder, artifact_path)

    # ---- metric histories -------------------------------------------------------------------------
    def get_metric_history(self, run_id: str, key: str) -> list[Metric]:
        return self._client.get_metric_history(run_id, key)

    def metric_histories(self, run_ids: list[str], key: str) -> dict[str, Points]:
        """`{run_id: points}` of metric `key`, in bulk where the store allows it: a SQL store's
        `get_metric_history_bulk` (private, <= SQL_CHUNK runs a query), a server's bulk endpoint
        (<= 100 runs, <= 2500 points a run: a run that comes back with 2500 points may be sampled and
        is read in full), else one `get_metric_history` per run."""
        from mlflow.store.tracking.rest_store import RestStore
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        backend = self._client._tracking_client.store  # the public client has no bulk history call
        if isinstance(backend, SqlAlchemyStore):
            return self._bulk_sql(backend, run_ids, key)
        if isinstance(backend, RestStore):
            return self._bulk_rest(backend, run_ids, key)
        return {r: self._points(r, key) for r in run_ids}

    def _points(self, run_id: str, key: str) -> Points:
        return [(int(m.step), int(m.timestamp), float(m.value)) for m in self._client.get_metric_history(run_id, key)]

    @staticmethod
    def _bulk_sql(backend: Any, run_ids: list[str], key: str) -> dict[str, Points]:
        out: dict[str, Points] = {}
        for i in range(0, len(run_ids), SQL_CHUNK):
            for m in backend.get_metric_history_bulk(list(run_ids[i : i + SQL_CHUNK]), key, max_results=2**62):
                out.setdefault(m.run_id, []).append((int(m.step), int(m.timestamp), float(m.value)))
        return out

    def _bulk_rest(self, backend: Any, run_ids: list[str], key: str) -> dict[str, Points]:
        from mlflow.utils.rest_utils import http_request_safe

        out: dict[str, Points] = {}
        for i in range(0, len(run_ids), REST_MAX_RUNS):
            chunk = list(run_ids[i : i + REST_MAX_RUNS])
            params = {"run_ids": chunk, "metric_key": key, "max_results": REST_MAX_POINTS}
            body = http_request_safe(backend.get_host_creds(), REST_BULK, "GET", params=params).json()
            for m in body.get("metrics", []):
                out.setdefault(m["run_id"], []).append((int(m.get("step", 0)), int(m.get("timestamp", 0)),
                                                         float(m["value"])))
        for run_id, points in list(out.items()):
            if len(points) >= REST_MAX_POINTS:  # possibly sampled by the server: read it in full
                out[run_id] = self._points(run_id, key)
        return out
