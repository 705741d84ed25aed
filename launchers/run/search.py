"""`sweep run` for a sweep with an Optuna `search`: trials run as cells, through the same loop
(`launchers.run.loop.SweepLoop`) and executors as a grid; `TrialSource` is the loop's cell source.

The source asks Optuna for up to `search.parallel` trials at a time; each trial's params make a cell
(`launchers.plan.grid.cell_for`: the same id, MLflow child run, checkpoints and retries as a grid cell);
when the cell's run FINISHES, the trial's value is the last logged value of `search.metric` in
MLflow, told to the study. A failed cell is retried (`search.retries`) before its trial is told
FAIL. The study lives in a journal file (default `<sweep folder>/optuna.journal`: append-only with
a lock file, safe on NFS with many writers, where SQLite's locking is not) or an RDB URL; running
the same command again resumes it (RUNNING trials are re-attached to their cells' jobs).
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, TextIO

from fp8rl_core.tracking import BEST_PREFIX, TAG_BEST_PARAMS, TAG_CELL_ID, TAG_TRIAL
from fp8rl_core.tracking.lifecycle import search_parent_status
from fp8rl_core.tracking.runs import find_or_create_cell_run, last_metric, log_summary
from fp8rl_core.tracking.store import retry_locked
from launchers.executors import Executor, JobHandle
from launchers.plan.cells import Cell
from launchers.plan.grid import cell_for
from launchers.run.driver import drive
from launchers.run.jobs import RunFn
from launchers.run.loop import SweepLoop
from launchers.run.session import SweepSession
from launchers.sweepfile.loading import Sweep
from launchers.sweepfile.schema import SearchSpec
from launchers.sweepfile.search_space import n_trials

TRIAL_TAG = TAG_TRIAL  # the cell run's tag: its trial number(s)
CELL_ATTR = TAG_CELL_ID  # the trial's user attribute: its cell id


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


class TrialSource:
    """Optuna trials as the loop's cells: asked while fewer than `search.parallel` are open, told when
    their cell ends (the value: the last logged `search.metric` of its MLflow run)."""

    def __init__(self, session: SweepSession, study: Any):
        self.session, self.study = session, study
        self.sweep, self.search = session.sweep, session.sweep.spec.search
        self.extra_trials = 0  # failed trials asked again (--retry-failed), beyond n_trials
        self.trials: dict[str, list[int]] = {}  # cell id -> open trial numbers (equal params share a cell)

    # ---- trials -> cells -----------------------------------------------------------------------------
    def initial(self) -> list[Cell]:
        """The RUNNING trials of a previous driver: re-attached to their cells (jobs, runs)."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        return [self._attach(t.number, cell_for(self.sweep, t.params, t.number)) for t in trials]

    def more(self) -> list[Cell]:
        """Ask for trials until `parallel` are open or n_trials exist; their cells."""
        from optuna.trial import TrialState

        dists = optuna_distributions(self.search)
        budget = n_trials(self.search) + self.extra_trials
        cells = []
        while self._open() < self.search.parallel and self._asked(TrialState.WAITING) < budget:
            trial = self.study.ask(dists)
            cell = cell_for(self.sweep, trial.params, trial.number)
            trial.set_user_attr(CELL_ATTR, cell.id)
            cells.append(self._attach(trial.number, cell))
        return cells

    def retry_failed(self) -> None:
        """`--retry-failed`, as for a grid: the cells' failed attempts no longer count, and each FAILED
        trial's params are asked again (a new trial on the same cell)."""
        from optuna.trial import TrialState

        self.session.forgive_failures()
        failed = self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
        for t in failed:
            self.study.enqueue_trial(dict(t.params), skip_if_exists=False)
        self.extra_trials = len(failed)
        if failed:
            self.session.say(f"retrying {len(failed)} failed trial(s)")

    def _asked(self, waiting: Any) -> int:
        """Trials asked so far (enqueued grid points wait to be asked)."""
        return sum(t.state != waiting for t in self.study.get_trials(deepcopy=False))

    def _open(self) -> int:
        return sum(len(v) for v in self.trials.values())

    def _attach(self, number: int, cell: Cell) -> Cell:
        self.trials.setdefault(cell.id, []).append(number)
        return cell

    # ---- the loop's questions ------------------------------------------------------------------------
    def admitted(self, actions: dict[str, str]) -> None:
        return None

    def tags(self, cell: Cell) -> dict[str, str]:
        return {TRIAL_TAG: ",".join(map(str, self.trials.get(cell.id, [])))}

    def submitted(self, cell: Cell, handle: JobHandle) -> None:
        numbers = self.trials.get(cell.id) or ["?"]
        self.session.say(f"trial {numbers[0]}: cell {cell.id} {cell.label()} submitted (job {handle.job_id})")

    def ended(self, cell: Cell, finished: bool) -> None:
        """Tell the cell's open trials: its metric when it finished, else FAIL."""
        from optuna.trial import TrialState

        value = self._metric(cell) if finished else None
        for number in self.trials.pop(cell.id, []):
            if value is None:
                self.study.tell(number, state=TrialState.FAIL)
                err = self.session.error_of(cell.id)
                self.session.say(f"trial {number}: FAILED {cell.label()}: "
                                 f"{err or 'no ' + self.search.metric + ' logged'}")
            else:
                self.study.tell(number, value)
                self.session.say(f"trial {number}: {self.search.metric} = {value:.4g} {cell.label()}")

    def _metric(self, cell: Cell) -> float | None:
        """The last logged value of search.metric in the cell's MLflow run (None if never logged)."""
        session = self.session
        run_id = session.state.record(cell.id).run_id
        if run_id is None:
            run_id, _ = retry_locked(find_or_create_cell_run, session.uri, session.exp_id,
                                     session.state.parent_run_id, cell.id)
        return last_metric(session.uri, run_id, self.search.metric)

    def finish(self) -> int:
        """The best trial (printed, logged to the parent run), the parent run's end, the exit code."""
        from optuna.trial import TrialState

        session = self.session
        done = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        completed_cells = {t.user_attrs.get(CELL_ATTR) for t in done}
        failed = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
                  if t.user_attrs.get(CELL_ATTR) not in completed_cells]  # not since retried to completion
        if done:
            best = self.study.best_trial
            session.say(f"best trial {best.number}: {self.search.metric} = {best.value:.4g} with {best.params}")
            log_summary(session.uri, session.state.parent_run_id, {f"{BEST_PREFIX}{self.search.metric}": best.value},
                        {TAG_BEST_PARAMS: repr(best.params)})
        session.say(f"search {self.sweep.experiment}: {len(done)} trials complete, {len(failed)} failed "
              f"(storage {self.sweep.study_storage()})")
        session.end_sweep(search_parent_status(len(done)))
        return 0 if done and not failed else 1


def run_trials(session: SweepSession, retry_failed: bool = False) -> int:
    """The search's walk: parent run (with the search's params), the study, then the loop."""
    search = session.sweep.spec.search
    session.setup({"search.sampler": search.sampler, "search.metric": search.metric,
                   "search.direction": search.direction, "search.n_trials": n_trials(search)})
    source = TrialSource(session, load_study(session.sweep))
    if retry_failed:
        source.retry_failed()
    return SweepLoop(session, source).drive(source.initial())


def run_search(sweep: Sweep, detach: bool = False, retry_failed: bool = False, executor: Executor | None = None,
               run_fn: RunFn | None = None, out: TextIO | None = None, poll_s: float = 2.0) -> int:
    """Run (or resume) the sweep's Optuna search. `detach` and `retry_failed` mean what they mean
    for a grid (launchers.run.driver.run_sweep): a search always detaches as a background driver."""
    def start() -> int:
        session = SweepSession(sweep, [], executor, run_fn, out, poll_s, retries=sweep.spec.search.retries)
        return run_trials(session, retry_failed)

    return drive(sweep, start, detach, retry_failed, executor, out)


def optuna_distributions(search: SearchSpec) -> dict[str, Any]:
    """{key: optuna distribution} (what `trial._suggest` / `study.ask(fixed_distributions)` take)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    out: dict[str, Any] = {}
    for key, p in search.params.items():
        if p.type == "categorical":
            out[key] = CategoricalDistribution(list(p.choices or []))
        elif p.type == "int":
            out[key] = IntDistribution(int(p.low), int(p.high), log=p.log, step=int(p.step or 1))
        else:
            out[key] = FloatDistribution(float(p.low), float(p.high), log=p.log,
                                         step=None if p.step is None else float(p.step))
    return out
