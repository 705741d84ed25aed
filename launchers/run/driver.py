"""`sweep run`: launch the cells that are not finished, watch them, retry failures, write the report.

    rc = run_sweep(load_sweep("sweeps/smoke.yaml"))        # returns when every cell has ended
    rc = run_sweep(sweep, detach=True)                     # submit (SLURM) / start in background, return

The shared steps live in `launchers.run.context.SweepRun`, the watch-and-retry loop in
`launchers.run.loop.Loop`; this module is the walk that strings them together. One walk: validate
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

import contextlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, TextIO

from fp8rl_core.tracking.store import TrackingUnreachable, retry_locked
from launchers.executors import Executor, JobHandle, Task
from launchers.plan import rules
from launchers.plan.cells import Cell
from launchers.plan.grid import expand
from launchers.run.context import SweepRun, job_config, supersede_outputs
from launchers.run.jobs import RunFn, report_stage
from launchers.run.loop import Loop
from launchers.run.state import DriverBusy, DriverLock, StageJob
from launchers.sweepfile.loading import Sweep

__all__ = ["Driver", "DriverStopped", "job_config", "run_sweep", "spawn_background", "stop_on_sigterm",
           "supersede_outputs"]


class DriverStopped(Exception):
    """SIGTERM (e.g. `sweep cancel` stopping a detached driver) or Ctrl-C."""


class Driver(SweepRun):
    # ---- 5) the whole run --------------------------------------------------------------------------
    def run(self, detach: bool = False, retry_failed: bool = False, report: bool = True) -> int:
        self.setup()
        if retry_failed:
            self.forgive_failures()
        actions, watch = self.assess([c.id for c in self.cells])
        counts = {a: sum(v == a for v in actions.values()) for a in sorted(set(actions.values()))}
        self.say(f"sweep {self.name}: {len(self.cells)} cells: " + ", ".join(f"{n} {a}" for a, n in counts.items())
                 + f" ({self.sweep.launcher.kind}, folder {self.sweep.folder})")
        for cid, action in actions.items():
            if action == rules.EXHAUSTED:
                self.say(f"  cell {cid} {self.by_id[cid].label()}: failed {self.state.cells[cid].failures()} "
                         f"time(s), not retried (sweep run FILE --retry-failed)")
        to_run = [c for c in self.cells if actions[c.id] == rules.RUN]
        dependency = self.warm_start(to_run) if to_run else None
        if detach:
            return self._detach(to_run, dependency)
        loop = Loop(self, watch, {cid for cid, a in actions.items() if a == rules.SKIP})
        try:
            loop.launch(to_run, dependency)
            loop.loop()
        except (KeyboardInterrupt, DriverStopped) as e:
            loop.stop(str(e) or "interrupted")
            return 130
        return self.finish(report)

    def _detach(self, to_run: list[Cell], dependency: str | None) -> int:
        """SLURM only (local --detach runs this driver in the background): submit the cells and the
        report stage, which waits for all of them (afterany), then return. Retries need a driver:
        `sweep run FILE` again waits for the live jobs and re-runs what failed."""
        handles: list[JobHandle] = []
        if to_run:
            handles = self.submit(self.tasks_for(to_run), f"afterok:{dependency}" if dependency else None)
        alive = [a.job_id for _, a in self.state.open_attempts() if a.kind == "slurm"]
        if alive:
            from launchers.executors.slurm import base_id

            after = "afterany:" + ":".join(sorted({base_id(j) for j in alive}, key=int))
            args = (self.uri, self.name, self.name, str(self.sweep.folder / "report"), self.state.parent_run_id,
                    len(self.cells), dict(self.sweep.spec.analysis), [c.id for c in self.cells])
            (h,) = self.executor.submit([Task("report", report_stage, args)], after)
            self.state.stages.append(StageJob("report", h.job_id, h.kind, h.stderr))
            self.save()
            self.say(f"submitted {len(handles)} cell job(s) (one array); report stage: job {h.job_id}")
        self.say(f"follow it: sweep status {self.sweep.name} --watch; stop it: sweep cancel {self.sweep.name}")
        return 0

    def finish(self, report: bool) -> int:
        from fp8rl_core.tracking.runs import finish_run

        mlflow = self.mlflow_states()
        done = sum(mlflow.get(c.id) == "FINISHED" for c in self.cells)
        failed = [c for c in self.cells if mlflow.get(c.id) != "FINISHED"]
        for c in failed:
            err = self.error_of(c.id)
            self.say(f"  FAILED {c.id} {c.label()}: {err or mlflow.get(c.id) or 'not run'}")
        fresh = self.changes or not (self.sweep.folder / "report" / "report.md").exists()
        if report and mlflow and fresh:  # nothing ran and a report exists: it is up to date
            try:
                from analysis.config import AnalysisConfig
                from analysis.report import make_report

                paths = make_report(self.uri, self.name, self.name, self.sweep.folder / "report",
                                    parent_run_id=self.state.parent_run_id,
                                    config=AnalysisConfig.from_dict(self.sweep.spec.analysis),
                                    cell_ids=[c.id for c in self.cells])  # not cells of an earlier file
                self.say(paths.verdicts_text)
                self.say(f"report: {paths.report}")
            except Exception as e:  # a report problem must not hide the cells' outcome
                self.say(f"report: failed ({type(e).__name__}: {e}); retry with `sweep report {self.sweep.name}`")
        retry_locked(finish_run, self.uri, self.state.parent_run_id, "FINISHED" if not failed else "FAILED")
        self.say(f"sweep {self.name}: {done}/{len(self.cells)} cells finished")
        return 0 if not failed else 1


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
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, cwd=sweep.cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    print(f"sweep {sweep.experiment}: driver running in the background (pid {proc.pid}), log {log_path}\n"
          f"follow it: sweep status {sweep.name} --watch; stop it: sweep cancel {sweep.name}")
    return 0


def _raise_stopped(signum: int, frame: Any) -> None:
    raise DriverStopped(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM (`sweep cancel` stopping this driver) raises DriverStopped in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_sweep(sweep: Sweep, detach: bool = False, retry_failed: bool = False, executor: Executor | None = None,
              run_fn: RunFn | None = None, out: TextIO | None = None, poll_s: float = 2.0,
              report: bool = True) -> int:
    """Run the sweep (see the module docstring). SweepError before anything is created on a bad file."""
    cells = expand(sweep)  # validates every cell: nothing is created for a sweep that fails here
    from launchers.plan.memory import refusal

    refused = refusal(sweep, cells)  # a cell that cannot fit the memory it requests: nothing is submitted
    if refused is not None:
        raise refused
    if detach and needs_background_driver(sweep) and executor is None:
        return spawn_background(sweep, retry_failed)
    with stop_on_sigterm():
        try:
            with DriverLock(sweep.folder):
                driver = Driver(sweep, cells, executor, run_fn, out, poll_s)
                return driver.run(detach=detach, retry_failed=retry_failed, report=report)
        except (DriverBusy, TrackingUnreachable) as e:
            print(f"sweep run: {e}", file=out or sys.stderr)
            return 3
