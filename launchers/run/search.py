"""`sweep run` for a sweep with an Optuna `search`: trials run as cells, through the same executors.

The driver asks Optuna for up to `search.parallel` trials at a time; each trial's params make a cell
(`launchers.plan.grid.cell_for`: the same id, MLflow child run, checkpoints and retries as a grid cell);
when the cell's run FINISHES, the trial's value is the last logged value of `search.metric` in
MLflow, told to the study. A failed cell is retried (`search.retries`) before its trial is told
FAIL. The study lives in a journal file (default `<sweep folder>/optuna.journal`: append-only with
a lock file, safe on NFS with many writers, where SQLite's locking is not) or an RDB URL; running
the same command again resumes it (RUNNING trials are re-attached to their cells' jobs).
"""
from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from fp8rl_core.tracking.store import TrackingUnreachable, retry_locked
from launchers.executors import Executor, JobHandle, is_alive
from launchers.plan import rules
from launchers.plan.cells import Cell
from launchers.plan.grid import cell_for
from launchers.run.context import SweepRun, handle_of
from launchers.run.driver import DriverStopped, needs_background_driver, spawn_background, stop_on_sigterm
from launchers.run.jobs import RunFn
from launchers.run.loop import Loop
from launchers.run.state import DriverBusy, DriverLock
from launchers.sweepfile.loading import Sweep
from launchers.sweepfile.search_space import n_trials, optuna_distributions

TRIAL_TAG = "optuna.trial"
CELL_ATTR = "cell_id"


def open_storage(location: str) -> Any:
    """An RDB URL as it is; a path -> JournalStorage over a journal file (created with its folder)."""
    if "://" in location:
        return location
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    Path(location).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(location))


def make_sampler(sweep: Sweep) -> Any:
    """tpe | random; grid is random over the enqueued grid points (Optuna's GridSampler calls
    `study.stop()`, which only works inside `study.optimize`, not with ask/tell)."""
    import optuna

    s = sweep.spec.search
    if s.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=s.seed)
    return optuna.samplers.RandomSampler(seed=s.seed)


def load_study(sweep: Sweep) -> Any:
    """Create or load the study; a new grid study gets every grid point enqueued, in file order."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s = sweep.spec.search
    study = optuna.create_study(study_name=sweep.experiment, storage=open_storage(sweep.study_storage()),
                                sampler=make_sampler(sweep), direction=s.direction, load_if_exists=True)
    if s.sampler == "grid" and not study.trials:
        keys = list(s.params)
        for values in itertools.product(*(s.params[k].choices for k in keys)):
            study.enqueue_trial(dict(zip(keys, values)))
    return study


class SearchDriver:
    def __init__(self, sweep: Sweep, executor: Executor | None = None, run_fn: RunFn | None = None,
                 out: TextIO | None = None, poll_s: float = 2.0):
        self.sweep, self.search = sweep, sweep.spec.search
        self.d = SweepRun(sweep, [], executor, run_fn, out, poll_s, retries=self.search.retries)
        self.study: Any = None
        self.extra_trials = 0  # failed trials asked again (--retry-failed), beyond n_trials
        self.trials: dict[str, list[int]] = {}  # cell id -> open trial numbers (equal params share a cell)
        self.active: dict[str, JobHandle] = {}  # cell id -> its alive job

    def run(self, retry_failed: bool = False) -> int:
        self.d.setup({"search.sampler": self.search.sampler, "search.metric": self.search.metric,
                      "search.direction": self.search.direction, "search.n_trials": n_trials(self.search)})
        self.study = load_study(self.sweep)
        from optuna.trial import TrialState

        if retry_failed:
            self._retry_failed(TrialState.FAIL)
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self._attach(t.number, cell_for(self.sweep, t.params, t.number))  # a previous driver's trials
        try:
            while True:
                self._fill()
                if not self.trials:
                    break
                time.sleep(self.d.poll_s)
                self._tick()
        except (KeyboardInterrupt, DriverStopped) as e:
            Loop(self.d, self.active, set()).stop(str(e) or "interrupted")
            return 130
        return self._summary()

    # ---- trials -> cells -----------------------------------------------------------------------------
    def _fill(self) -> None:
        """Ask for trials until `parallel` run at once or n_trials exist; launch their cells."""
        from optuna.trial import TrialState

        dists = optuna_distributions(self.search)
        budget = n_trials(self.search) + self.extra_trials
        while self._open() < self.search.parallel and self._asked(TrialState.WAITING) < budget:
            trial = self.study.ask(dists)
            cell = cell_for(self.sweep, trial.params, trial.number)
            trial.set_user_attr(CELL_ATTR, cell.id)
            self._attach(trial.number, cell)

    def _retry_failed(self, fail: Any) -> None:
        """`--retry-failed`, as for a grid: the cells' failed attempts no longer count, and each FAILED
        trial's params are asked again (a new trial on the same cell)."""
        self.d.forgive_failures()
        failed = self.study.get_trials(deepcopy=False, states=(fail,))
        for t in failed:
            self.study.enqueue_trial(dict(t.params), skip_if_exists=False)
        self.extra_trials = len(failed)
        if failed:
            self.d.say(f"retrying {len(failed)} failed trial(s)")

    def _asked(self, waiting: Any) -> int:
        """Trials asked so far (enqueued grid points wait to be asked)."""
        return sum(t.state != waiting for t in self.study.get_trials(deepcopy=False))

    def _open(self) -> int:
        return sum(len(v) for v in self.trials.values())

    def _attach(self, number: int, cell: Cell) -> None:
        self.d.add_cell(cell)
        known = cell.id in self.trials
        self.trials.setdefault(cell.id, []).append(number)
        if not known:
            self._advance(cell)

    def _advance(self, cell: Cell) -> None:
        """Launch, watch, or settle the cell (its trials told) from MLflow + the job on record."""
        rec = self.d.state.cells.get(cell.id)
        att = rec.open_attempt() if rec else None
        job = self.d.poll([handle_of(cell.id, att)]).get(att.job_id) if att else None
        status = self.d.mlflow_states().get(cell.id)  # after the poll: an ended job's status is final
        self.d.settle_cell(cell.id, status, job)
        action = rules.decide(status, rec, job, self.d.retries)
        if action == rules.WAIT:
            self.active[cell.id] = handle_of(cell.id, att)
        elif action == rules.RUN:
            numbers = self.trials[cell.id]
            dependency = self.d.warm_start([cell])  # cached after the first trial: usually a no-op
            tasks = self.d.tasks_for([cell], {cell.id: {TRIAL_TAG: ",".join(map(str, numbers))}})
            (h,) = self.d.submit(tasks, f"afterok:{dependency}" if dependency else None)
            self.active[cell.id] = h
            self.d.say(f"trial {numbers[0]}: cell {cell.id} {cell.label()} submitted (job {h.job_id})")
        else:
            self._tell(cell, status == "FINISHED")
        self.d.save()

    def _tick(self) -> None:
        states = self.d.poll(list(self.active.values()))  # one scheduler call for every trial
        for cid, h in list(self.active.items()):
            if not is_alive(states.get(h.job_id)):
                del self.active[cid]
                self._advance(self.d.by_id[cid])

    def _tell(self, cell: Cell, finished: bool) -> None:
        from optuna.trial import TrialState

        value = self._metric(cell) if finished else None
        for number in self.trials.pop(cell.id, []):
            if value is None:
                self.study.tell(number, state=TrialState.FAIL)
                err = self.d.error_of(cell.id)
                self.d.say(f"trial {number}: FAILED {cell.label()}: {err or 'no ' + self.search.metric + ' logged'}")
            else:
                self.study.tell(number, value)
                self.d.say(f"trial {number}: {self.search.metric} = {value:.4g} {cell.label()}")

    def _metric(self, cell: Cell) -> float | None:
        """The last logged value of search.metric in the cell's MLflow run (None if never logged)."""
        from fp8rl_core.tracking.runs import find_or_create_cell_run, last_metric

        run_id = self.d.state.record(cell.id).run_id
        if run_id is None:
            run_id, _ = retry_locked(find_or_create_cell_run, self.d.uri, self.d.exp_id,
                                     self.d.state.parent_run_id, cell.id)
        return last_metric(self.d.uri, run_id, self.search.metric)

    def _summary(self) -> int:
        from optuna.trial import TrialState

        from fp8rl_core.tracking.runs import finish_run, log_summary

        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        completed_cells = {t.user_attrs.get(CELL_ATTR) for t in done}
        failed = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                  if t.user_attrs.get(CELL_ATTR) not in completed_cells]  # not since retried to completion
        if done:
            best = self.study.best_trial
            self.d.say(f"best trial {best.number}: {self.search.metric} = {best.value:.4g} with {best.params}")
            log_summary(self.d.uri, self.d.state.parent_run_id, {f"best_{self.search.metric}": best.value},
                        {"best_params": repr(best.params)})
        self.d.say(f"search {self.sweep.experiment}: {len(done)} trials complete, {len(failed)} failed "
                   f"(storage {self.sweep.study_storage()})")
        retry_locked(finish_run, self.d.uri, self.d.state.parent_run_id, "FINISHED" if done else "FAILED")
        return 0 if done and not failed else 1


def run_search(sweep: Sweep, detach: bool = False, retry_failed: bool = False, executor: Executor | None = None,
               run_fn: RunFn | None = None, out: TextIO | None = None, poll_s: float = 2.0) -> int:
    """Run (or resume) the sweep's Optuna search. `detach` and `retry_failed` mean what they mean
    for a grid (launchers.run.driver.run_sweep): a search always detaches as a background driver."""
    if detach and needs_background_driver(sweep) and executor is None:
        return spawn_background(sweep, retry_failed)
    with stop_on_sigterm():
        try:
            with DriverLock(sweep.folder):
                return SearchDriver(sweep, executor, run_fn, out, poll_s).run(retry_failed)
        except (DriverBusy, TrackingUnreachable) as e:
            print(f"sweep run: {e}", file=out or sys.stderr)
            return 3
