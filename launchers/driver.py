"""`sweep run`: launch the cells that are not finished, watch them, retry failures, write the report.

    rc = run_sweep(load_sweep("sweeps/smoke.yaml"))        # returns when every cell has ended
    rc = run_sweep(sweep, detach=True)                     # submit (SLURM) / start in background, return

One walk: validate (expand; nothing exists yet if this fails) -> take the sweep's driver lock ->
MLflow experiment + parent run (created here, so parallel jobs never race to create them) -> ONE
`cell_states` query + ONE scheduler poll -> per cell: skip / wait / run / exhausted
(`launchers.survey`) -> a SCHEDULED child run per cell to launch -> warm-start stage -> submit ->
progress, polling the scheduler once per tick for all jobs -> retries -> report stage -> parent run
ended. The sweep state (`launchers.state`) is saved after every change, so `sweep status` and
`sweep cancel` work from any shell, and running the same command again resumes the sweep.
Exit codes: 0 every cell finished; 1 some cell failed; 3 could not start (another driver holds the
sweep, or the tracking server does not answer); 130 stopped (Ctrl-C, SIGTERM).
"""
from __future__ import annotations

import contextlib
import dataclasses
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

from fp8rl_core.config import RunConfig, TrackingSpec
from fp8rl_core.schema import to_dict

from launchers import survey
from launchers.cells import Cell, cell_run_config
from launchers.executors import Executor, JobHandle, Task, make_executor
from launchers.grid import expand
from launchers.job import CellJob, RunFn, report_stage, warm_start_configs, warm_start_stage
from launchers.monitor import Monitor
from launchers.state import Attempt, DriverBusy, DriverLock, SweepState, load_state, save_state
from launchers.sweep_file import Sweep

SUPERSEDED = ".superseded"  # <folder>/cells/.superseded/<cell>-<old run>: outputs of a replaced run


class DriverStopped(Exception):
    """SIGTERM (e.g. `sweep cancel` stopping a detached driver) or Ctrl-C."""


def job_config(sweep: Sweep, cell: Cell, run_id: str, parent_run_id: str) -> RunConfig:
    """The config the cell's job runs: cell_run_config plus an absolute warm-start cache, so jobs that
    start in another directory share it (cache_dir is not part of the cell id)."""
    cfg = cell_run_config(sweep, cell, run_id, parent_run_id)
    cache = Path(cfg.warmstart.cache_dir).expanduser()
    if not cache.is_absolute():
        ws = dataclasses.replace(cfg.warmstart, cache_dir=str(sweep.cwd / cache))
        cfg = dataclasses.replace(cfg, warmstart=ws)
    return cfg


def supersede_outputs(out_dir: Path, run_id: str, old_run_id: str | None) -> Path | None:
    """Move a cell's outputs aside when they are not those of MLflow run `run_id` (its previous run
    was deleted, or their origin is unknown): never delete or overwrite another run's outputs, and
    never resume from them. The owner is the run on record, else the one the metrics were shipped to."""
    if not out_dir.is_dir() or not any(out_dir.iterdir()):
        return None
    owner = old_run_id
    shipped = out_dir / "metrics.jsonl.shipped.json"
    if owner is None and shipped.exists():
        import json

        owner = json.loads(shipped.read_text()).get("run_id")
    if owner == run_id:
        return None
    dest = out_dir.parent / SUPERSEDED / f"{out_dir.name}-{(owner or 'unknown')[:12]}-{int(time.time())}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(out_dir), str(dest))
    return dest


class Driver:
    def __init__(self, sweep: Sweep, cells: list[Cell], executor: Executor | None = None,
                 run_fn: RunFn | None = None, out: TextIO | None = None, poll_s: float = 2.0):
        self.sweep, self.cells = sweep, cells
        self.by_id = {c.id: c for c in cells}
        self.uri, self.name = sweep.tracking_uri(), sweep.experiment
        self.retries = sweep.launcher.retries
        self._executors: dict[str, Executor] = {}
        if executor is not None:
            self._executors[executor.kind] = executor
        self.executor = self.executor_of(sweep.launcher.kind)
        self.run_fn, self.out, self.poll_s = run_fn, out or sys.stdout, poll_s
        self.state = load_state(sweep.folder) or SweepState(sweep.experiment, kind=sweep.launcher.kind)
        self.state.kind = sweep.launcher.kind
        self.exp_id: str | None = None
        self.changes = 0  # jobs this driver submitted or saw end: the report is out of date

    # ---- plumbing -------------------------------------------------------------------------------
    def executor_of(self, kind: str) -> Executor:
        if kind not in self._executors:
            self._executors[kind] = make_executor(self.sweep, kind)
        return self._executors[kind]

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def save(self) -> None:
        save_state(self.sweep.folder, self.state)

    def mlflow_states(self) -> dict[str, str]:
        from fp8rl_core.tracking.runs import cell_states

        return survey.retry_locked(cell_states, self.uri, self.name, self.name)

    # ---- 1) experiment and parent run -------------------------------------------------------------
    def setup(self, extra_params: dict[str, Any] | None = None) -> None:
        from mlflow import MlflowClient

        from fp8rl_core.tracking.runs import create_parent_run, ensure_experiment

        if not survey.tracking_reachable(self.uri):
            raise survey.TrackingUnreachable(f"the tracking server {self.uri} does not answer (/health); start "
                                             f"it (`sweep server`) or check tracking.uri; nothing was submitted")
        self.exp_id = survey.retry_locked(ensure_experiment, self.uri, self.name)
        spec = to_dict(self.sweep.spec)
        params = {"sweep_file": self.sweep.name, "launcher.kind": self.sweep.launcher.kind,
                  "launcher.max_parallel": self.sweep.launcher.max_parallel, "n_cells": len(self.cells),
                  **{f"grid.{a.key}": list(a.values) for a in self.sweep.axes}, **(extra_params or {})}
        parent = survey.retry_locked(create_parent_run, self.uri, self.name, self.name, params=params, config=spec)
        self.state.parent_run_id = parent
        survey.retry_locked(MlflowClient(self.uri).update_run, parent, "RUNNING")
        self.save()

    # ---- 2) what to do with each cell --------------------------------------------------------------
    def survey(self) -> tuple[dict[str, str], dict[str, JobHandle]]:
        """(action per cell id, alive jobs to watch by cell id): one poll, then one MLflow query (in
        this order: a job seen ended has already written its run's final status)."""
        jobs = survey.poll_attempts(self.state.open_attempts(), self.executor_of)
        mlflow = self.mlflow_states()
        actions, watch = {}, {}
        for cell in self.cells:
            rec = self.state.cells.get(cell.id)
            att = rec.open_attempt() if rec else None
            job_state = jobs.get(att.job_id) if att else None
            if rec is not None and survey.settle(rec, mlflow.get(cell.id), job_state):
                self._end_stale_run(rec, mlflow.get(cell.id))
            actions[cell.id] = survey.decide(mlflow.get(cell.id), rec, job_state, self.retries)
            if actions[cell.id] == survey.WAIT:
                watch[cell.id] = survey.handle_of(cell.id, att)
        self.save()
        return actions, watch

    def _end_stale_run(self, rec: Any, status: str | None) -> None:
        """A dead job left its run RUNNING/SCHEDULED: mark it KILLED so the UI tells the truth."""
        if rec.run_id and status in ("RUNNING", "SCHEDULED"):
            from mlflow import MlflowClient

            client = MlflowClient(self.uri)
            if survey.retry_locked(client.get_run, rec.run_id).info.status in ("RUNNING", "SCHEDULED"):  # still
                survey.retry_locked(client.set_terminated, rec.run_id, "KILLED")

    # ---- 3) child runs and tasks -------------------------------------------------------------------
    def add_cell(self, cell: Cell) -> None:
        """A cell made after the start (an Optuna trial's)."""
        if cell.id not in self.by_id:
            self.cells.append(cell)
            self.by_id[cell.id] = cell

    def tasks_for(self, cells: list[Cell], extra_tags: dict[str, dict[str, str]] | None = None) -> list[Task]:
        """A SCHEDULED child run per cell (or its existing run) and the job that runs it;
        `extra_tags`: cell id -> more tags for a new run (e.g. the Optuna trial number)."""
        from fp8rl_core.tracking.runs import find_or_create_cell_run

        from launchers.cells import cell_tags

        tasks = []
        for cell in cells:
            rec = self.state.record(cell.id)
            cfg0 = cell_run_config(self.sweep, cell)
            run_id, _ = survey.retry_locked(
                find_or_create_cell_run, self.uri, self.exp_id, self.state.parent_run_id, cell.id,
                tags={**cell_tags(self.sweep, cell), **(extra_tags or {}).get(cell.id, {})},
                params=_public(cfg0), config=_public(cfg0))
            moved = supersede_outputs(Path(cfg0.output_dir), run_id, rec.run_id)
            if moved:
                self.say(f"cell {cell.id}: its previous run is gone; old outputs moved to {moved}")
            rec.run_id, rec.params = run_id, dict(cell.params)
            cfg = job_config(self.sweep, cell, run_id, self.state.parent_run_id)
            tasks.append(Task(cell.id, CellJob(self.run_fn), (to_dict(cfg),)))
        return tasks

    def submit(self, tasks: list[Task], dependency: str | None = None) -> list[JobHandle]:
        handles = self.executor.submit(tasks, dependency) if dependency else self.executor.submit(tasks)
        self.changes += len(handles)
        for h in handles:
            self.state.record(h.name).attempts.append(Attempt(h.job_id, h.kind, h.submitted, h.stderr))
        self.save()
        return handles

    # ---- 4) warm start -----------------------------------------------------------------------------
    def warm_start(self, cells: list[Cell]) -> str | None:
        """Run the warm-start stage once for the cells about to launch. SLURM: a job the cells
        depend on (its id is returned, for afterok); local/debug: here, before any cell starts."""
        pending = warm_start_configs([job_config(self.sweep, c, "", "") for c in cells])
        if not pending:
            return None
        configs = [to_dict(dataclasses.replace(c, tracking=TrackingSpec())) for c in pending]
        if self.executor.kind != "slurm":
            ws = pending[0].warmstart
            until = "" if ws.target_accuracy is None else f", until {ws.target_accuracy:.0%} greedy dev accuracy"
            self.say(f"warm start: {len(pending)} checkpoint(s) to train (at most {ws.steps} steps{until}) ...")
            t0 = time.time()
            warm_start_stage(configs)
            self.say(f"warm start: done in {time.time() - t0:.0f}s")
            return None
        from launchers.state import StageJob

        (h,) = self.executor.submit([Task("warmstart", warm_start_stage, (configs,))])
        self.state.stages.append(StageJob("warmstart", h.job_id, h.kind, h.stderr))
        self.save()
        self.say(f"warm start: job {h.job_id}; the cells wait for it (afterok)")
        return h.job_id

    # ---- 5) the whole run --------------------------------------------------------------------------
    def run(self, detach: bool = False, retry_failed: bool = False, report: bool = True) -> int:
        self.setup()
        if retry_failed:
            for rec in self.state.cells.values():
                for att in rec.attempts:
                    if att.outcome == "failed":
                        att.outcome = "forgiven"  # no longer counts against retries
        actions, watch = self.survey()
        counts = {a: sum(v == a for v in actions.values()) for a in sorted(set(actions.values()))}
        self.say(f"sweep {self.name}: {len(self.cells)} cells: " + ", ".join(f"{n} {a}" for a, n in counts.items())
                 + f" ({self.sweep.launcher.kind}, folder {self.sweep.folder})")
        for cid, action in actions.items():
            if action == survey.EXHAUSTED:
                self.say(f"  cell {cid} {self.by_id[cid].label()}: failed {self.state.cells[cid].failures()} "
                         f"time(s), not retried (sweep run FILE --retry-failed)")
        to_run = [c for c in self.cells if actions[c.id] == survey.RUN]
        dependency = self.warm_start(to_run) if to_run else None
        if detach:
            return self._detach(to_run, dependency)
        monitor = Monitor(self, watch, {cid for cid, a in actions.items() if a == survey.SKIP})
        try:
            monitor.launch(to_run, dependency)
            monitor.loop()
        except (KeyboardInterrupt, DriverStopped) as e:
            monitor.stop(str(e) or "interrupted")
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
            from launchers.state import StageJob

            after = "afterany:" + ":".join(sorted({base_id(j) for j in alive}, key=int))
            args = (self.uri, self.name, self.name, str(self.sweep.folder / "report"), self.state.parent_run_id,
                    len(self.cells))
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
            rec = self.state.cells.get(c.id)
            err = rec.last().error if rec and rec.last() else None
            self.say(f"  FAILED {c.id} {c.label()}: {err or mlflow.get(c.id) or 'not run'}")
        fresh = self.changes or not (self.sweep.folder / "report" / "report.md").exists()
        if report and mlflow and fresh:  # nothing ran and a report exists: it is up to date
            try:
                from analysis.report import make_report

                paths = make_report(self.uri, self.name, self.name, self.sweep.folder / "report",
                                    parent_run_id=self.state.parent_run_id)
                self.say(f"report: {paths.report}")
            except Exception as e:  # a report problem must not hide the cells' outcome
                self.say(f"report: failed ({type(e).__name__}: {e}); retry with `sweep report {self.sweep.name}`")
        survey.retry_locked(finish_run, self.uri, self.state.parent_run_id, "FINISHED" if not failed else "FAILED")
        self.say(f"sweep {self.name}: {done}/{len(self.cells)} cells finished")
        return 0 if not failed else 1


def _public(cfg: RunConfig) -> dict[str, Any]:
    """The config logged as params: what the cell computes (no run ids, which MLflow shows anyway)."""
    data = to_dict(cfg)
    data.pop("tracking", None)
    return data


def spawn_background(sweep: Sweep) -> int:
    """`sweep run --detach` for local/debug: this same command, in its own session, logging to
    `<folder>/driver.log` (it survives the shell; `sweep cancel` stops it by its pid)."""
    sweep.folder.mkdir(parents=True, exist_ok=True)
    log_path = sweep.folder / "driver.log"
    argv = [sys.executable, "-m", "launchers.cli", "run", sweep.name, *sweep.overrides]
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
    import threading

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
    if detach and sweep.launcher.kind != "slurm" and executor is None:
        return spawn_background(sweep)
    with stop_on_sigterm():
        try:
            with DriverLock(sweep.folder):
                driver = Driver(sweep, cells, executor, run_fn, out, poll_s)
                return driver.run(detach=detach, retry_failed=retry_failed, report=report)
        except (DriverBusy, survey.TrackingUnreachable) as e:
            print(f"sweep run: {e}", file=out or sys.stderr)
            return 3
