"""The session of one `sweep run`: what the loop, the grid and the Optuna search share.

`SweepSession` holds the sweep, its cells, the sweep state on disk (launchers.run.state), the
executors and the MLflow parent run, and does the steps every sweep needs: set up the experiment and
parent run, survey the cells (ONE scheduler poll per kind, then ONE MLflow query; each cell's action
from the one rules table, launchers.plan.rules), create child runs and tasks, submit, run the warm
start. Status writes go through the one lifecycle (fp8rl_core.tracking.lifecycle).

Why a named object passed around (not a base class): the loop (`loop.py`) and the cell sources
(`cell_sources.py`, `search.py`) each hold a session; none of them is one. This module imports none of them.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from fp8rl_core.config import TrackingSpec
from fp8rl_core.config.schema import to_dict
from fp8rl_core.tracking import METRICS_FILE
from fp8rl_core.tracking.lifecycle import Lifecycle
from fp8rl_core.tracking.runs import cell_states, create_parent_run, ensure_experiment, find_or_create_cell_run
from fp8rl_core.tracking.store import TrackingUnreachable, retry_locked, tracking_reachable
from launchers.executors import Executor, Executors, JobHandle, Task, poll_by_kind
from launchers.plan import rules
from launchers.plan.cells import CELLS_SUBFOLDER, Cell, cell_run_config, cell_tags
from launchers.run.cell_facts import driver_session, handle_of, job_config, public_config, settle, supersede_outputs
from launchers.run.jobs import CellJob, RunFn, warm_start_configs, warm_start_stage
from launchers.run.state import Attempt, StageJob, SweepState, load_state, save_state
from launchers.sweepfile.loading import Sweep


class SweepSession:
    """One `sweep run`'s shared state; `retries`: launcher.retries for a grid, search.retries for a search."""

    def __init__(self, sweep: Sweep, cells: list[Cell], executor: Executor | None = None,
                 run_fn: RunFn | None = None, out: TextIO | None = None, poll_s: float = 2.0,
                 retries: int | None = None):
        self.sweep, self.cells = sweep, cells
        self.by_id = {c.id: c for c in cells}
        self.uri, self.name = sweep.tracking_uri(), sweep.experiment
        self.lifecycle = Lifecycle(self.uri, retry=retry_locked)
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

    def error_of(self, cell_id: str) -> str | None:
        rec = self.state.cells.get(cell_id)
        return rec.last().error if rec and rec.last() else None

    # ---- 1) experiment and parent run -------------------------------------------------------------
    def setup(self, extra_params: dict[str, Any] | None = None) -> None:
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
        self.lifecycle.sweep_started(parent)
        self.save()

    def end_sweep(self, status: str) -> None:
        """End the parent run as `status` (decided by fp8rl_core.tracking.lifecycle)."""
        self.lifecycle.sweep_ended(self.state.parent_run_id, status)

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
        (the lifecycle's rule: KILLED), after shipping what the cell logged (its metrics.jsonl)."""
        rec = self.state.cells.get(cell_id)
        if rec is None or not settle(rec, status, job_state):
            return
        if rec.run_id:
            self.lifecycle.job_gone(rec.run_id, status, self.cell_dir(cell_id) / METRICS_FILE)

    # ---- 3) child runs and tasks -------------------------------------------------------------------
    def add_cell(self, cell: Cell) -> None:
        """A cell made after the start (an Optuna trial's)."""
        if cell.id not in self.by_id:
            self.cells.append(cell)
            self.by_id[cell.id] = cell

    def tasks_for(self, cells: list[Cell], extra_tags: dict[str, dict[str, str]] | None = None) -> list[Task]:
        """A SCHEDULED child run per cell (or its existing run) and the job that runs it;
        `extra_tags`: cell id -> more tags for a new run (e.g. the Optuna trial number)."""
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
        depend on (its id is returned, for afterok); local/debug: here, before any cell starts.
        A no-op (None) when the cache already holds every checkpoint they need."""
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


__all__ = ["SweepSession"]
