"""Where each cell stands: MLflow's run status + the job's state + the attempts on record -> an action.

Shared by `sweep run` (what to launch), `sweep status` and `sweep plan`. The rules, per cell:

    its job is alive (pending/running/requeued)  -> wait   (whatever MLflow says: a requeued job's
                                                             run may read FAILED for a moment)
    MLflow run FINISHED                          -> skip   (a finished cell never re-runs silently)
    failed attempts > launcher.retries           -> exhausted (skip; `sweep run --retry-failed`)
    otherwise (new, SCHEDULED/RUNNING with a dead job, FAILED, KILLED) -> run

An attempt whose job is no longer alive is settled once: finished if its run FINISHED, else failed
(a job that died with its run still RUNNING was killed: OOM, node failure, SIGKILL).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, TypeVar

from launchers.executors.base import ALIVE, JobHandle
from launchers.progress import error_tail
from launchers.state import Attempt, CellRecord

T = TypeVar("T")
WAIT, SKIP, RUN, EXHAUSTED = "wait", "skip", "run", "exhausted"


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


class TrackingUnreachable(RuntimeError):
    """The MLflow tracking server does not answer."""


def tracking_reachable(uri: str, timeout_s: float = 3.0) -> bool:
    """False when an http(s) tracking server does not answer /health (MLflow's own client would
    retry for minutes); other stores are assumed reachable."""
    if not uri.startswith(("http://", "https://")):
        return True
    from fp8rl_core.tracking.server import health_ok

    return health_ok(uri, timeout_s)


def handle_of(cell_id: str, att: Attempt) -> JobHandle:
    return JobHandle(cell_id, att.job_id, att.kind, None, att.stderr, att.submitted)


def poll_attempts(attempts: Iterable[tuple[str, Attempt]], executors: Callable[[str], Any]) -> dict[str, str]:
    """job_id -> job state for the attempts given, with one poll per executor kind (one sacct)."""
    by_kind: dict[str, list[JobHandle]] = {}
    for cell_id, att in attempts:
        by_kind.setdefault(att.kind, []).append(handle_of(cell_id, att))
    out: dict[str, str] = {}
    for kind, handles in by_kind.items():
        out.update(executors(kind).poll(handles))
    return out


def settle(record: CellRecord, mlflow_status: str | None, job_state: str | None) -> bool:
    """Give the open attempt its outcome once its job is no longer alive; True when it changed."""
    att = record.open_attempt()
    if att is None or job_state in ALIVE:
        return False
    att.outcome = "finished" if mlflow_status == "FINISHED" else "failed"
    if att.outcome == "failed":
        att.error = error_tail(att.stderr) or (f"job ended ({job_state}) with its run {mlflow_status}"
                                               if mlflow_status else f"job ended ({job_state}) before its run started")
    return True


def decide(mlflow_status: str | None, record: CellRecord | None, job_state: str | None, retries: int) -> str:
    """wait | skip | exhausted | run (see the module docstring)."""
    if record is not None and record.open_attempt() is not None and job_state in ALIVE:
        return WAIT
    if mlflow_status == "FINISHED":
        return SKIP
    if record is not None and record.failures() > retries:
        return EXHAUSTED
    return RUN


def display_state(mlflow_status: str | None, record: CellRecord | None, job_state: str | None,
                  retries: int) -> str:
    """One word for tables: new, pending, running, finished, failed, killed, exhausted, scheduled."""
    action = decide(mlflow_status, record, job_state, retries)
    if action == WAIT:
        return "running" if job_state == "running" else "pending"
    if action == EXHAUSTED:
        return "exhausted"
    if mlflow_status is None:
        return "new"
    if mlflow_status in ("RUNNING", "SCHEDULED") and record is not None and record.attempts:
        return "killed" if record.last().outcome in ("failed", "cancelled") else mlflow_status.lower()
    return mlflow_status.lower()
