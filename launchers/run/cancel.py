"""`sweep cancel FILE`: stop a sweep's driver, cancel its queued and running jobs, mark their runs KILLED.

Order matters: the driver first (SIGTERM to the pid in the sweep's driver lock while it is held,
so that it submits nothing more and does not retry what we cancel), then every job on record in ONE
call per scheduler (`scancel id ...`; SIGINT to local controllers), a bounded wait until they have
left the queue, and last the MLflow runs: KILLED (cancelled attempts do not count as failures, so
the next `sweep run` resumes those cells from their checkpoints). Which status each run gets is the
lifecycle's rule (fp8rl_core.tracking.lifecycle.cancel_status); the runs' statuses are read with one
MLflow query before the signal and one after, whatever the number of cells.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from fp8rl_core.tracking import METRICS_FILE
from fp8rl_core.tracking.lifecycle import PARENT_CANCELLED, Lifecycle
from fp8rl_core.tracking.runs import run_statuses
from fp8rl_core.tracking.store import retry_locked
from launchers.executors import Executors, JobHandle, by_kind, is_alive
from launchers.plan.cells import CELLS_SUBFOLDER
from launchers.process import is_sweep_driver, terminate
from launchers.run.cell_facts import handle_of
from launchers.run.state import LOCK_FILE, SweepState, is_locked, load_state, save_state
from launchers.sweepfile.loading import Sweep

DRIVER_WAIT_S = 40.0
QUEUE_WAIT_S = 60.0


def driver_pids(sweep: Sweep) -> list[int]:
    """The live driver of this sweep: the pid written in its lock file, trusted only while the lock
    is held (a pid from a past driver may belong to another process by now)."""
    if not is_locked(sweep.folder):
        return []
    try:
        words = (sweep.folder / LOCK_FILE).read_text().split()
        pid = int(words[1]) if len(words) == 2 and words[0] == "pid" else None
    except (OSError, ValueError):
        return []
    return [pid] if pid is not None and is_sweep_driver(pid) else []


def stop_drivers(pids: Sequence[int], wait_s: float = DRIVER_WAIT_S) -> list[int]:
    """SIGTERM each driver and wait for it to exit; the pids still alive after `wait_s`."""
    return terminate(pids, wait_s, is_sweep_driver)


def _run_statuses(sweep: Sweep, state: SweepState, cell_ids: set[str]) -> dict[str, str]:
    """`{cell_id: status}` of the run each cell's state records (the run its open attempt writes),
    from ONE MLflow query."""

    run_of = {cid: rec.run_id for cid in cell_ids if (rec := state.cells.get(cid)) and rec.run_id}
    found = retry_locked(run_statuses, sweep.tracking_uri(), sweep.experiment, list(run_of.values()))
    return {cid: found[rid] for cid, rid in run_of.items() if rid in found}


def _mark_killed(sweep: Sweep, state: SweepState, before: dict[str, str]) -> int:
    """End each run that was open when its job was signalled (`before`: the statuses read just
    before) as the lifecycle says for a cancel (KILLED unless it finished since), after shipping
    what the cell logged."""
    lifecycle = Lifecycle(sweep.tracking_uri())
    now = _run_statuses(sweep, state, set(before))
    n = 0
    for cid, was in before.items():
        buffer = sweep.folder / CELLS_SUBFOLDER / cid / METRICS_FILE
        n += lifecycle.cancelled(state.cells[cid].run_id, was, now.get(cid), buffer)
    return n


def cancel_handles(sweep: Sweep, state: SweepState, handles: Sequence[JobHandle],
                   executors: Callable[[str], Any], wait_s: float = QUEUE_WAIT_S) -> list[str]:
    """Cancel `handles` (one call per kind), wait until they are gone, settle them as cancelled and
    mark their runs KILLED. Returns the job ids still queued after `wait_s` (should be none)."""
    cells = {h.name for h in handles}
    before = _run_statuses(sweep, state, cells)
    left: list[str] = []
    for kind, hs in by_kind(handles).items():
        ex = executors(kind)
        ex.cancel(hs)
        left += _wait_gone(ex, hs, wait_s)
    for cid in cells:
        rec = state.cells.get(cid)
        att = rec.open_attempt() if rec else None
        if att is not None:
            att.outcome, att.error = "cancelled", "cancelled by sweep cancel"
    _mark_killed(sweep, state, before)
    return left


def _wait_gone(ex: Any, handles: Sequence[JobHandle], wait_s: float) -> list[str]:
    deadline = time.monotonic() + wait_s
    while True:
        if hasattr(ex, "queued"):  # SLURM: until squeue lists none of them
            left = ex.queued(handles)
        else:
            left = [j for j, s in ex.poll(handles).items() if is_alive(s)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def cancel_sweep(sweep: Sweep, out: TextIO) -> int:
    """The whole `sweep cancel` (see the module docstring). 0 when nothing is left queued."""
    pids = driver_pids(sweep)
    if pids:
        stuck = stop_drivers(pids)
        print(f"stopped the sweep's driver (pid {', '.join(map(str, pids))})" +
              (f"; still alive: {stuck}" if stuck else ""), file=out)
    state = load_state(sweep.folder)  # after the driver stopped: it saved what it cancelled itself
    if state is None:
        print(f"sweep {sweep.experiment}: nothing to cancel (it never ran from {sweep.folder})", file=out)
        return 0
    executors = Executors(sweep)
    handles = [handle_of(cid, att) for cid, att in state.open_attempts()]
    stages = [JobHandle(s.name, s.job_id, s.kind, None, s.stderr) for s in state.stages if s.kind == "slurm"]
    left = cancel_handles(sweep, state, handles + stages, executors) if handles or stages else []
    save_state(sweep.folder, state)
    if state.parent_run_id and (handles or pids):  # a finished sweep's parent run stays as it is
        Lifecycle(sweep.tracking_uri(), retry=retry_locked).sweep_ended(state.parent_run_id, PARENT_CANCELLED)
    print(f"sweep {sweep.experiment}: cancelled {len(handles)} cell job(s)"
          + (f" and {len(stages)} stage job(s)" if stages else "")
          + (f"; STILL QUEUED: {', '.join(left)}" if left else "; nothing left in the queue"), file=out)
    return 0 if not left else 1
