"""Who decides an MLflow run's status: one table from what happened (an exception, a dead job, a
cancel, a requeue, the cells' end states) to the status of a cell's run and of the sweep's parent run.

Why here: the training loop, the cell job, the sweep driver, its loop, the search and `sweep cancel`
all end runs. Each used to write its own rule, and two copies of one rule drift (the exception ->
status mapping was written twice, the parent run's end rule three ways). Now they ask this module:

    status = run_status(error)                       # the training loop: how its sink closes
    Lifecycle(uri).job_ended(run_id, error, requeued, buffer)   # the cell job, when run() raised
    Lifecycle(uri).job_gone(run_id, mlflow_status, buffer)      # the driver: a dead job left it open
    Lifecycle(uri).cancelled(run_id, before, now, buffer)       # `sweep cancel`
    Lifecycle(uri).sweep_ended(parent_id, grid_parent_status(finished, total))

The rules are pure functions (tested on their own); `Lifecycle` applies them through `runs.py`,
which ships a cell's unshipped metrics before it ends the run. Nothing here imports MLflow at import
time, so the training loop can use the rules for free.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fp8rl_core.tracking import runs
from fp8rl_core.tracking.contract import END_STATUSES, FAILED, FINISHED, KILLED, OPEN_STATUSES, RUNNING

PAUSED = RUNNING  # run(stop_after=N) stopped on purpose: the run goes on in a later call
PARENT_STOPPED = KILLED  # the driver stopped (Ctrl-C, SIGTERM) with nothing of the sweep left running
PARENT_CANCELLED = KILLED  # `sweep cancel` stopped the sweep's driver or jobs


# ---- cell runs ---------------------------------------------------------------------------------
def run_status(error: BaseException | None) -> str:
    """How a run that stops with `error` (None: it completed) ends.

    SystemExit is submitit's exit after a requeue (preemption, timeout): the run goes on in the next
    job, so it stays RUNNING. KeyboardInterrupt is a cancel (SIGINT to a local job, Ctrl-C): KILLED,
    so `sweep run` resumes it and the attempt does not count. Anything else is the cell's own FAILED.
    """
    if error is None:
        return FINISHED
    if isinstance(error, SystemExit):
        return RUNNING
    if isinstance(error, KeyboardInterrupt):
        return KILLED
    return FAILED


def job_status(error: BaseException, requeued: bool) -> str | None:
    """What the cell job (launchers.run.jobs.CellJob) marks when `run()` raised `error`; None: nothing.

    The same table as `run_status`, with one exception: a SystemExit that is not submitit's requeue
    (`requeued` False) is left alone: the job exits, the driver sees it dead and settles the run."""
    if isinstance(error, SystemExit) and not requeued:
        return None
    return run_status(error)


def gone_status(status: str | None) -> str | None:
    """A cell whose job is no longer alive: KILLED if its run was left open (the job died without
    ending it: OOM, node failure, SIGKILL), else None (the run ended itself)."""
    return KILLED if status in OPEN_STATUSES else None


def cancel_status(before: str | None, now: str | None) -> str | None:
    """`sweep cancel`: KILLED for a run that was open when its job was signalled (`before`) and has
    not FINISHED since (`now`); None for a run that had ended before the signal (it keeps its status).

    KILLED even over a FAILED written meanwhile: a run that was open when the cancel came and failed
    since died of the cancel (SIGINT in the middle of a cleanup, the SIGKILL that follows it, a broken
    collective on another rank), not of its own error; its attempt counts as cancelled."""
    if before in END_STATUSES or now == FINISHED:
        return None
    return KILLED


# ---- the sweep's parent run --------------------------------------------------------------------
def grid_parent_status(finished: int, total: int) -> str:
    """A grid sweep (and its report stage): FINISHED when every one of its `total` current cells
    FINISHED (runs of cells an earlier version of the file had do not count), else FAILED."""
    return FINISHED if finished >= total else FAILED


def search_parent_status(completed_trials: int) -> str:
    """A search: FINISHED when at least one trial completed (its result is the best trial), else FAILED."""
    return FINISHED if completed_trials else FAILED


# ---- applying them -----------------------------------------------------------------------------
class Lifecycle:
    """The status writes of one tracking store, each decided by the rules above (`runs.py` writes)."""

    def __init__(self, uri: str, retry: Callable[..., Any] | None = None):
        self.uri = uri
        self._retry = retry  # retry_locked for callers that share a SQLite file with many jobs

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._retry(fn, *args, **kwargs) if self._retry else fn(*args, **kwargs)

    def job_ended(self, run_id: str, error: BaseException, requeued: bool, buffer_path: str | Path) -> str | None:
        """The cell job's `run()` raised: RUNNING again (a requeue), or ended as `job_status` says,
        after shipping what the cell logged; the status written, or None."""
        status = job_status(error, requeued)
        if status == RUNNING:
            runs.start_run(self.uri, run_id)
        elif status is not None:
            text = None if status != FAILED else f"{type(error).__name__}: {error}"
            runs.end_run(self.uri, run_id, status, buffer_path=buffer_path, error=text)
        return status

    def job_gone(self, run_id: str, mlflow_status: str | None, buffer_path: str | Path) -> bool:
        """A cell's job is no longer alive: end its run as `gone_status` says; True when written."""
        status = gone_status(mlflow_status)
        return status is not None and runs.end_run(self.uri, run_id, status, buffer_path=buffer_path)

    def cancelled(self, run_id: str, before: str | None, now: str | None, buffer_path: str | Path) -> bool:
        """`sweep cancel` signalled the cell's job: end its run as `cancel_status` says."""
        status = cancel_status(before, now)
        return status is not None and runs.end_run(self.uri, run_id, status, buffer_path=buffer_path, only_open=False)

    def sweep_started(self, parent_run_id: str) -> None:
        """The driver took the sweep: its parent run RUNNING (again)."""
        self._call(runs.start_run, self.uri, parent_run_id)

    def sweep_ended(self, parent_run_id: str, status: str) -> None:
        """End the sweep's parent run as `status` (from grid_parent_status, search_parent_status,
        PARENT_STOPPED or PARENT_CANCELLED), whatever it was before."""
        self._call(runs.finish_run, self.uri, parent_run_id, status)
