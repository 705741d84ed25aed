"""Low-level MLflow store helpers every tracking module shares (no run lifecycle here: see `runs.py`).

- URIs: `sqlite_path(uri)` is the ONE parser of `sqlite:///` URIs (relative and absolute paths),
  `absolute_uri(uri, cwd)` anchors a relative one, `store_exists(uri)` looks without creating;
- reachability: `health_ok(url)`, `tracking_reachable(uri)`, `TrackingUnreachable`;
- SQLite's "database is locked" under many writers: `retry_locked(fn, ...)`;
- what a run records: `flatten_params` (MLflow's key/value limits), `context_tags` (host, user, git, SLURM);
- `set_status(client, run_id, status)`: the one place a run's status is written (runs.py and the sink call it).
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

if TYPE_CHECKING:  # pragma: no cover
    from mlflow import MlflowClient

T = TypeVar("T")
SQLITE = "sqlite:///"  # MLflow is imported by the functions that call it: URI helpers stay cheap
MAX_KEY_LEN = 250
MAX_PARAM_VALUE_LEN = 6000
MAX_TAG_VALUE_LEN = 8000
MAX_PARAMS_PER_BATCH = 100
OPEN_STATUSES = ("SCHEDULED", "RUNNING")
END_STATUSES = ("FINISHED", "FAILED", "KILLED")
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


def set_status(client: MlflowClient, run_id: str, status: str, end_time: int | None = None) -> None:
    """Write a run's status: RUNNING (started, or requeued) or FINISHED/FAILED/KILLED (ended)."""
    if status == "RUNNING":
        client.update_run(run_id, status="RUNNING")
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


def log_params(client: MlflowClient, run_id: str, params: Mapping[str, Any]) -> None:
    """Flatten and log `params` in batches of <= 100 (MLflow's per-request limit)."""
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in flatten_params(params).items()]
    for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i : i + MAX_PARAMS_PER_BATCH], synchronous=True)


def set_tags(client: MlflowClient, run_id: str, tags: Mapping[str, Any]) -> None:
    from mlflow.entities import RunTag

    items = [RunTag(k, str(v)[:MAX_TAG_VALUE_LEN]) for k, v in tags.items()]
    for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=items[i : i + MAX_PARAMS_PER_BATCH], synchronous=True)


def log_config_artifact(client: MlflowClient, run_id: str, config: Mapping[str, Any],
                        name: str = "config.yaml") -> None:
    """The full (untruncated) config as a YAML artifact at the run's artifact root."""
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        client.log_artifact(run_id, str(path))
