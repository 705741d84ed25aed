"""The run-state object of one `sweep run`: what the driver, its loop and the Optuna search share.

`SweepRun` holds the sweep, its cells, the sweep state on disk (launchers.run.state), the executors
and the MLflow parent run, and does the steps every driver needs: set up the experiment and parent
run, survey the cells (ONE scheduler poll per kind, then ONE MLflow query; each cell's state and
action from the one rules table, launchers.plan.rules), create child runs and tasks, submit, run the
warm start. The driver (`driver.py`), the loop (`loop.py`) and the search (`search.py`) use it; it
imports none of them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from fp8rl_core.config import RunConfig, TrackingSpec
from fp8rl_core.config.schema import to_dict
from fp8rl_core.tracking import METRICS_FILE
from fp8rl_core.tracking.store import TrackingUnreachable, retry_locked, tracking_reachable
from launchers.executors import Executor, Executors, JobHandle, Task, is_alive, poll_by_kind
from launchers.plan import rules
from launchers.plan.cells import CELLS_SUBFOLDER, Cell, cell_run_config, cell_tags
from launchers.run.jobs import CellJob, RunFn, warm_start_configs, warm_start_stage
from launchers.run.progress import error_tail
from launchers.run.state import Attempt, CellRecord, StageJob, SweepState, load_state, save_state
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
    if mlflow_status == "FINISHED":
        att.outcome = "finished"
        return True
    orphaned = att.kind in LOCAL_KINDS and att.driver is not None and att.driver != driver_session()
    if orphaned and mlflow_status != "FAILED":
        att.outcome, att.error = "lost", f"its driver stopped before it ({job_state}); not counted as a failure"
        return True
    att.outcome = "failed"
    att.error = error_tail(att.stderr) or (f"job ended ({job_state}) with its run {mlflow_status}"
                                           if mlflow_status else f"job ended ({job_state}) before its run started")
    return True


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
    """The config logged as params: what the cell computes (no run ids, which MLflow shows anyway)."""
    data = to_dict(cfg)
    data.pop("tracking", None)
    return data


class SweepRun:
    """One `sweep run`'s shared state; `retries`: launcher.retries for a grid, search.retries for a search."""

    def __init__(self, sweep: Sweep, cells: list[Cell], executor: Executor | None = None,
                 run_fn: RunFn | None = None, out: TextIO | None = None, poll_s: float = 2.0,
                 retries: int | None = None):
        self.sweep, self.cells = sweep, cells
        self.by_id = {c.id: c for c in cells}
        self.uri, self.name = sweep.tracking_uri(), sweep.experiment
        self.retries = sweep.launcher.retries if retries is None else retries
        self.executors = Executors(sweep, executor)
        self.executor = self.executors(sweep.launcher.kind)
        self.run_fn, self.out, self.poll_s = run_fn, out or sys.stdout, poll_s
        self.state = load_state(sweep.folder) or SweepState(sweep.experiment, kind=sweep.launcher.kind)
        self.state.kind = sweep.launcher.kind
        self.exp_id: str | None = None
        self.changes = 0  # jobs this driver submitted or saw end: the report is out of date

    # ---- plumbing -------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def save(self) -> None:
        save_state(self.sweep.folder, self.state)

    def cell_dir(self, cell_id: str) -> Path:
        return self.sweep.folder / CELLS_SUBFOLDER / cell_id

    def mlflow_states(self) -> dict[str, str]:
        from fp8rl_core.tracking.runs import cell_states

        return retry_locked(cell_states, self.uri, self.name, self.name)

    def poll(self, handles: list[JobHandle]) -> dict[str, str]:
        return poll_by_kind(handles, self.executors)

    def forgive_failures(self) -> int:
        """`--retry-failed`: failed attempts no longer count against retries (grid and search alike)."""
        n = 0
        for rec in self.state.cells.values():
            for att in rec.attempts:
                if att.outcome == "failed":
                    att.outcome, n = "forgiven", n + 1
        self.save()
        return n

    # ---- 1) experiment and parent run -------------------------------------------------------------
    def setup(self, extra_params: dict[str, Any] | None = None) -> None:
        from fp8rl_core.tracking.runs import create_parent_run, ensure_experiment, start_run

        if not tracking_reachable(self.uri):
            raise TrackingUnreachable(f"the tracking server {self.uri} does not answer (/health); start "
                                      f"it (`sweep server`) or check tracking.uri; nothing was submitted")
        self.exp_id = retry_locked(ensure_experiment, self.uri, self.name)
        spec = to_dict(self.sweep.spec)
        params = {"sweep_file": self.sweep.name, "launcher.kind": self.sweep.launcher.kind,
                  "launcher.max_parallel": self.sweep.launcher.max_parallel, "n_cells": len(self.cells),
                  **{f"grid.{a.key}": list(a.values) for a in self.sweep.axes}, **(extra_params or {})}
        parent = retry_locked(create_parent_run, self.uri, self.name, self.name, params=params, config=spec)
        self.state.parent_run_id = parent
        retry_locked(start_run, self.uri, parent)
        self.save()

    # ---- 2) where each cell stands -----------------------------------------------------------------
    def assess(self, cell_ids: list[str]) -> tuple[dict[str, str], dict[str, JobHandle]]:
        """(action per cell id, alive jobs to watch by cell id): one poll, then one MLflow query (in
        this order: a job seen ended has already written its run's final status). Dead jobs settled."""
        open_atts = {cid: att for cid, att in self.state.open_attempts() if cid in set(cell_ids)}
        jobs = self.poll([handle_of(cid, att) for cid, att in open_atts.items()])
        mlflow = self.mlflow_states()
        actions, watch = {}, {}
        for cid in cell_ids:
            rec = self.state.cells.get(cid)
            att = open_atts.get(cid)
            job_state = jobs.get(att.job_id) if att else None
            self.settle_cell(cid, mlflow.get(cid), job_state)
            actions[cid] = rules.decide(mlflow.get(cid), rec, job_state, self.retries)
            if actions[cid] == rules.WAIT:
                watch[cid] = handle_of(cid, att)
        self.save()
        return actions, watch

    def settle_cell(self, cell_id: str, status: str | None, job_state: str | None) -> None:
        """Settle the cell's open attempt if its job ended; a dead job that left its run open ends it
        KILLED, after shipping what the cell logged (its metrics.jsonl) to MLflow."""
        rec = self.state.cells.get(cell_id)
        if rec is None or not settle(rec, status, job_state):
            return
        if rec.run_id and status in ("RUNNING", "SCHEDULED"):
            from fp8rl_core.tracking.runs import end_run

            end_run(self.uri, rec.run_id, "KILLED", buffer_path=self.cell_dir(cell_id) / METRICS_FILE)

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

        tasks = []
        for cell in cells:
            rec = self.state.record(cell.id)
            cfg0 = cell_run_config(self.sweep, cell)
            run_id, _ = retry_locked(
                find_or_create_cell_run, self.uri, self.exp_id, self.state.parent_run_id, cell.id,
                tags={**cell_tags(self.sweep, cell), **(extra_tags or {}).get(cell.id, {})},
                params=public_config(cfg0), config=public_config(cfg0))
            moved = supersede_outputs(Path(cfg0.output_dir), run_id, rec.run_id)
            if moved:
                self.say(f"cell {cell.id}: its previous run is gone; old outputs moved to {moved}")
            rec.run_id, rec.params = run_id, dict(cell.params)
            cfg = job_config(self.sweep, cell, run_id, self.state.parent_run_id)
            tasks.append(Task(cell.id, CellJob(self.run_fn), (to_dict(cfg),), ranks=self.sweep.launcher.world_size))
        return tasks

    def submit(self, tasks: list[Task], dependency: str | None = None) -> list[JobHandle]:
        handles = self.executor.submit(tasks, dependency) if dependency else self.executor.submit(tasks)
        self.changes += len(handles)
        for h in handles:
            self.state.record(h.name).attempts.append(Attempt(h.job_id, h.kind, h.submitted, h.stderr,
                                                              driver=driver_session()))
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
        (h,) = self.executor.submit([Task("warmstart", warm_start_stage, (configs,))])
        self.state.stages.append(StageJob("warmstart", h.job_id, h.kind, h.stderr))
        self.save()
        self.say(f"warm start: job {h.job_id}; the cells wait for it (afterok)")
        return h.job_id

    def error_of(self, cell_id: str) -> str | None:
        rec = self.state.cells.get(cell_id)
        return rec.last().error if rec and rec.last() else None


__all__ = ["SweepRun", "driver_session", "handle_of", "job_config", "public_config", "settle", "supersede_outputs"]
