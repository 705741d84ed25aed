"""The one rules table: a cell's state -> what `sweep run` does with it, and how `sweep plan` says it.

`sweep plan`, `sweep run` (the driver, its loop and the Optuna search) and `sweep status` all read a
cell's state through `cell_state` and its action through `RULES`, so they cannot disagree. A cell's
state comes from three facts: MLflow's run status, the attempts on record (launchers.run.state) and
whether the job of its open attempt is alive (one scheduler poll):

    its open attempt's job is alive         -> pending | running   wait  (whatever MLflow says: a
                                                                          requeued job's run may read
                                                                          FAILED for a moment)
    MLflow run FINISHED                     -> finished            skip  (never re-run silently)
    failed attempts > retries               -> exhausted           skip  (`sweep run --retry-failed`)
    no MLflow run                           -> new                 run
    SCHEDULED, never submitted              -> scheduled           run   (the driver died before submitting)
    SCHEDULED/RUNNING, no job alive         -> killed              run   (OOM, node failure, SIGKILL)
    FAILED / KILLED                         -> failed / killed     run

Pure: records are duck-typed (`open_attempt()`, `failures()`, `attempts`); nothing here imports
launchers.run.
"""
from __future__ import annotations

from typing import Any

from fp8rl_core.tracking import FINISHED, OPEN_STATUSES
from fp8rl_core.tracking import RUNNING as RUN_RUNNING
from launchers.executors.base import ALIVE, RUNNING

WAIT, SKIP, RUN, EXHAUSTED = "wait", "skip", "run", "exhausted"

# state -> (action of `sweep run`, the word `sweep plan` shows)
RULES: dict[str, tuple[str, str]] = {
    "new": (RUN, "run"),
    "unknown": (RUN, "run"),  # plan without a readable store: `sweep run` looks first
    "scheduled": (RUN, "run"),
    "failed": (RUN, "rerun"),
    "killed": (RUN, "rerun"),
    "pending": (WAIT, "wait"),
    "running": (WAIT, "wait"),
    "finished": (SKIP, "skip"),
    "exhausted": (EXHAUSTED, "skip (retries used up)"),
}


def _key(state: str) -> str:
    return state.split(" ", 1)[0].lower()


def action_of(state: str) -> str:
    """What `sweep run` does with a cell in `state`: run | wait | skip | exhausted ('?' if unknown)."""
    return RULES.get(_key(state), ("?", "?"))[0]


def plan_word(state: str) -> str:
    """How `sweep plan` words the action: run, rerun, wait, skip, skip (retries used up)."""
    return RULES.get(_key(state), ("?", "?"))[1]


def cell_state(mlflow_status: str | None, record: Any | None, job_state: str | None, retries: int) -> str:
    """The cell's state (a key of RULES) from its MLflow status, its record and its job's state."""
    if record is not None and record.open_attempt() is not None and job_state in ALIVE:
        return "running" if job_state == RUNNING else "pending"
    if mlflow_status == FINISHED:
        return "finished"
    if record is not None and record.failures() > retries:
        return "exhausted"
    if mlflow_status is None:
        return "new"
    if mlflow_status in OPEN_STATUSES:  # no job of ours alive runs it
        submitted = record is not None and bool(record.attempts)
        return "killed" if submitted or mlflow_status == RUN_RUNNING else "scheduled"
    return mlflow_status.lower()


def decide(mlflow_status: str | None, record: Any | None, job_state: str | None, retries: int) -> str:
    """wait | skip | exhausted | run."""
    return action_of(cell_state(mlflow_status, record, job_state, retries))
