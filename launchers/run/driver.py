"""`sweep run`: launch the cells that are not finished, watch them, retry failures, write the report.

    rc = run_sweep(load_sweep("sweeps/smoke.yaml"))        # returns when every cell has ended
    rc = run_sweep(sweep, detach=True)                     # submit (SLURM) / start in background, return

The shared steps live in the session (`launchers.run.session.SweepSession`), the watch-and-retry
loop in `launchers.run.loop.SweepLoop` (fed by a cell source: `cell_sources.GridSource` here,
`search.TrialSource` for an Optuna search); this module is the walk that strings them together and
the frame every `sweep run` shares (`drive`: background driver, lock, SIGTERM). One walk: validate
(expand; nothing exists yet if this fails) -> take the sweep's driver lock ->
MLflow experiment + parent run (created here, so parallel jobs never race to create them) -> ONE
`cell_states` query + ONE scheduler poll -> per cell: skip / wait / run / exhausted
(`launchers.plan.rules`) -> a SCHEDULED child run per cell to launch -> warm-start stage -> submit ->
progress, polling the scheduler once per tick for all jobs -> retries -> report stage -> parent run
ended. The sweep state (`launchers.run.state`) is saved after every change, so `sweep status` and
`sweep cancel` work from any shell, and running the same command again resumes the sweep.
Exit codes: 0 every cell finished; 1 some cell failed; 3 could not start (another driver holds the
sweep, or the tracking server does not answer); 130 stopped (Ctrl-C, SIGTERM).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from fp8rl_core.tracking.store import TrackingUnreachable
from launchers.executors import Executor, JobHandle, Task
from launchers.plan.cells import Cell
from launchers.plan.grid import expand
from launchers.process import spawn_detached, stop_on_sigterm
from launchers.run.cell_sources import GridSource
from launchers.run.jobs import RunFn, report_stage
from launchers.run.loop import SweepLoop
from launchers.run.session import SweepSession
from launchers.run.state import DriverBusy, DriverLock, StageJob
from launchers.sweepfile.loading import Sweep

__all__ = ["drive", "needs_background_driver", "run_sweep", "spawn_background"]


def needs_background_driver(sweep: Sweep) -> bool:
    """`--detach`, the same for grid and search sweeps: the sweep goes on without this shell. A grid
    sweep on SLURM needs no driver for that (its cells and a report stage are submitted, the cluster
    runs them); every other sweep (local/debug, or a search, which asks Optuna for each trial) keeps
    its driver, in the background. Retries need a driver in every case."""
    return sweep.launcher.kind != "slurm" or sweep.spec.search is not None


def spawn_background(sweep: Sweep, retry_failed: bool = False) -> int:
    """`sweep run --detach` for local/debug: this same command, in its own session, logging to
    `<folder>/driver.log` (it survives the shell; `sweep cancel` stops it by its pid)."""
    sweep.folder.mkdir(parents=True, exist_ok=True)
    log_path = sweep.folder / "driver.log"
    argv = [sys.executable, "-m", "launchers.cli", "run", sweep.name, *sweep.overrides]
    if retry_failed:
        argv.append("--retry-failed")
    pid = spawn_detached(argv, sweep.cwd, log_path)
    print(f"sweep {sweep.experiment}: driver running in the background (pid {pid}), log {log_path}\n"
          f"follow it: sweep status {sweep.name} --watch; stop it: sweep cancel {sweep.name}")
    return 0


def drive(sweep: Sweep, start: Callable[[], int], detach: bool = False, retry_failed: bool = False,
          executor: Executor | None = None, out: TextIO | None = None) -> int:
    """The frame of every `sweep run` (grid or search): `--detach` as a background driver where one
    is needed, else `start()` under the sweep's driver lock with SIGTERM stopping it cleanly.
    3 when another driver holds the sweep or the tracking server does not answer."""
    if detach and needs_background_driver(sweep) and executor is None:
        return spawn_background(sweep, retry_failed)
    with stop_on_sigterm():
        try:
            with DriverLock(sweep.folder):
                return start()
        except (DriverBusy, TrackingUnreachable) as e:
            print(f"sweep run: {e}", file=out or sys.stderr)
            return 3


def run_grid(session: SweepSession, detach: bool = False, retry_failed: bool = False, report: bool = True) -> int:
    """The grid's walk: parent run, survey, warm start, then the loop (or, detached on SLURM, submit)."""
    session.setup()
    if retry_failed:
        session.forgive_failures()
    source = GridSource(session, report)
    loop = SweepLoop(session, source)
    if not detach:
        return loop.drive(source.initial())
    to_run = loop.admit(source.initial())
    return submit_detached(session, to_run, session.warm_start(to_run) if to_run else None)


def submit_detached(session: SweepSession, to_run: list[Cell], dependency: str | None) -> int:
    """SLURM only (local --detach runs the driver in the background): submit the cells and the
    report stage, which waits for all of them (afterany), then return. Retries need a driver:
    `sweep run FILE` again waits for the live jobs and re-runs what failed."""
    s = session
    handles: list[JobHandle] = []
    if to_run:
        handles = s.submit(s.tasks_for(to_run), f"afterok:{dependency}" if dependency else None)
    alive = [a.job_id for _, a in s.state.open_attempts() if a.kind == "slurm"]
    if alive:
        from launchers.executors.slurm import base_id

        after = "afterany:" + ":".join(sorted({base_id(j) for j in alive}, key=int))
        args = (s.uri, s.name, s.name, str(s.sweep.folder / "report"), s.state.parent_run_id,
                len(s.cells), dict(s.sweep.spec.analysis), [c.id for c in s.cells])
        (h,) = s.executor.submit([Task("report", report_stage, args)], after)
        s.state.stages.append(StageJob("report", h.job_id, h.kind, h.stderr))
        s.save()
        s.say(f"submitted {len(handles)} cell job(s) (one array); report stage: job {h.job_id}")
    s.say(f"follow it: sweep status {s.sweep.name} --watch; stop it: sweep cancel {s.sweep.name}")
    return 0


def run_sweep(sweep: Sweep, detach: bool = False, retry_failed: bool = False, executor: Executor | None = None,
              run_fn: RunFn | None = None, out: TextIO | None = None, poll_s: float = 2.0,
              report: bool = True) -> int:
    """Run the sweep (see the module docstring). SweepError before anything is created on a bad file."""
    cells = expand(sweep)  # validates every cell: nothing is created for a sweep that fails here
    from launchers.plan.memory import refusal

    refused = refusal(sweep, cells)  # a cell that cannot fit the memory it requests: nothing is submitted
    if refused is not None:
        raise refused

    def start() -> int:
        return run_grid(SweepSession(sweep, cells, executor, run_fn, out, poll_s), detach, retry_failed, report)

    return drive(sweep, start, detach, retry_failed, executor, out)
