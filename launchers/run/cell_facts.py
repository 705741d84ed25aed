"""What a sweep's driver knows about one cell and its outputs, as pure helpers (no MLflow writes,
no scheduler calls): the handle of an attempt's job, how an attempt that ended is settled, the config
a cell's job runs, and moving aside outputs that belong to another run.

The session (`session.py`) and `sweep status` (`status.py`) use them; this module imports neither.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from fp8rl_core.config import RunConfig
from fp8rl_core.tracking import FAILED, FINISHED, METRICS_FILE
from fp8rl_core.tracking.sink import run_params
from launchers.executors import JobHandle, is_alive
from launchers.plan.cells import Cell, cell_run_config
from launchers.run.progress import error_tail
from launchers.run.state import Attempt, CellRecord
from launchers.sweepfile.loading import Sweep

SUPERSEDED = ".superseded"  # <folder>/cells/.superseded/<cell>-<old run>: outputs of a replaced run
LOCAL_KINDS = ("local", "debug")  # jobs that die with the driver that started them


PROCESS_START = time.time()


def driver_session() -> str:
    """This driver process, as written in the attempts it submits (pid and start time)."""
    return f"{os.getpid()}-{int(PROCESS_START)}"


def handle_of(cell_id: str, att: Attempt) -> JobHandle:
    return JobHandle(cell_id, att.job_id, att.kind, None, att.stderr, att.submitted)


def settle(record: CellRecord, mlflow_status: str | None, job_state: str | None) -> bool:
    """Give the open attempt its outcome once its job is no longer alive; True when it changed.

    finished: its run FINISHED. lost: a local job whose driver died before it (another driver session)
    and whose run did not fail by itself: the driver's death, not the cell's, so it does not count
    against the cell's retries. failed: anything else (OOM, node failure, an exception)."""
    att = record.open_attempt()
    if att is None or is_alive(job_state):
        return False
    if mlflow_status == FINISHED:
        att.outcome = "finished"
        return True
    orphaned = att.kind in LOCAL_KINDS and att.driver is not None and att.driver != driver_session()
    if orphaned and mlflow_status != FAILED:
        att.outcome, att.error = "lost", f"its driver stopped before it ({job_state}); not counted as a failure"
        return True
    att.outcome = "failed"
    att.error = error_tail(att.stderr) or (f"job ended ({job_state}) with its run {mlflow_status}"
                                           if mlflow_status else f"job ended ({job_state}) before its run started")
    return True


def job_config(sweep: Sweep, cell: Cell, run_id: str, parent_run_id: str) -> RunConfig:
    """The config the cell's job runs: launchers.plan.cells.cell_run_config, whose paths are already
    absolute, so every attempt runs (and logs) exactly what the driver logged as the run's params."""
    return cell_run_config(sweep, cell, run_id, parent_run_id)


def supersede_outputs(out_dir: Path, run_id: str, old_run_id: str | None) -> Path | None:
    """Move a cell's outputs aside when they are not those of MLflow run `run_id` (its previous run
    was deleted, or their origin is unknown): never delete or overwrite another run's outputs, and
    never resume from them. The owner is the run on record, else the one the metrics were shipped to."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return None
    owner = old_run_id
    shipped = out_dir / f"{METRICS_FILE}.shipped.json"
    if owner is None and shipped.exists():
        owner = json.loads(shipped.read_text()).get("run_id")
    if owner == run_id:
        return None
    dest = out_dir.parent / SUPERSEDED / f"{out_dir.name}-{(owner or 'unknown')[:12]}-{int(time.time())}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(out_dir), str(dest))
    return dest


def public_config(cfg: RunConfig) -> dict[str, Any]:
    """The config logged as params: fp8rl_core.tracking.sink.run_params, the one rule the core uses too."""
    return run_params(cfg)


__all__ = ["driver_session", "handle_of", "job_config", "public_config", "settle", "supersede_outputs"]
