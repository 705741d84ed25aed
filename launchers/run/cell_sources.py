"""Where the sweep loop's cells come from: a fixed grid (here) or Optuna trials (`search.py`).

The loop (`loop.py`) is the same for both: it admits cells (one survey: skip, wait, run), launches
the ones to run, watches their jobs, settles and retries them. A source only answers what differs:

    initial()           the cells known at the start (a grid: all; a search: a previous driver's trials)
    more()              cells that are new now (a grid: none; a search: trials asked as others end)
    admitted(actions)   the survey of a batch of cells (a grid prints its plan line)
    tags(cell)          extra tags of a cell's new MLflow run (a search: the trial numbers)
    submitted(cell, h)  a cell's job was submitted
    ended(cell, done)   a cell ended for good: finished, or failed with no retries left
    finish()            the sweep's end: report, parent run status (fp8rl_core.tracking.lifecycle), exit code
"""
from __future__ import annotations

from typing import Protocol

from fp8rl_core.tracking import FINISHED
from fp8rl_core.tracking.lifecycle import grid_parent_status
from launchers.executors import JobHandle
from launchers.plan import rules
from launchers.plan.cells import Cell
from launchers.run.session import SweepSession
from launchers.run.sweep_report import finished_count, write_report


class CellSource(Protocol):
    def initial(self) -> list[Cell]: ...

    def more(self) -> list[Cell]: ...

    def admitted(self, actions: dict[str, str]) -> None: ...

    def tags(self, cell: Cell) -> dict[str, str]: ...

    def submitted(self, cell: Cell, handle: JobHandle) -> None: ...

    def ended(self, cell: Cell, finished: bool) -> None: ...

    def finish(self) -> int: ...


class GridSource:
    """Every cell of the expanded grid, known at the start; `report`: write the report at the end."""

    def __init__(self, session: SweepSession, report: bool = True):
        self.session, self.report = session, report

    def initial(self) -> list[Cell]:
        return list(self.session.cells)

    def more(self) -> list[Cell]:
        return []

    def admitted(self, actions: dict[str, str]) -> None:
        """One line for the whole plan, then each cell whose retries are used up."""
        session = self.session
        counts = {a: sum(v == a for v in actions.values()) for a in sorted(set(actions.values()))}
        session.say(f"sweep {session.name}: {len(session.cells)} cells: "
                    + ", ".join(f"{n} {a}" for a, n in counts.items())
                    + f" ({session.sweep.launcher.kind}, folder {session.sweep.folder})")
        for cid, action in actions.items():
            if action == rules.EXHAUSTED:
                failures = session.state.cells[cid].failures()
                session.say(f"  cell {cid} {session.by_id[cid].label()}: failed {failures} time(s), "
                            f"not retried (sweep run FILE --retry-failed)")

    def tags(self, cell: Cell) -> dict[str, str]:
        return {}

    def submitted(self, cell: Cell, handle: JobHandle) -> None:
        return None

    def ended(self, cell: Cell, finished: bool) -> None:
        return None

    def finish(self) -> int:
        """Each unfinished cell's error, the report (when something changed), the parent run's end."""
        session = self.session
        mlflow = session.mlflow_states()
        done = finished_count(mlflow, [c.id for c in session.cells])
        for c in session.cells:
            if mlflow.get(c.id) != FINISHED:
                session.say(f"  FAILED {c.id} {c.label()}: {session.error_of(c.id) or mlflow.get(c.id) or 'not run'}")
        fresh = session.changes or not (session.sweep.folder / "report" / "report.md").exists()
        if self.report and mlflow and fresh:  # nothing ran and a report exists: it is up to date
            self._report()
        session.end_sweep(grid_parent_status(done, len(session.cells)))
        session.say(f"sweep {session.name}: {done}/{len(session.cells)} cells finished")
        return 0 if done == len(session.cells) else 1

    def _report(self) -> None:
        session = self.session
        try:
            paths = write_report(session.uri, session.name, session.name, session.sweep.folder / "report",
                                 session.state.parent_run_id, session.sweep.spec.analysis,
                                 [c.id for c in session.cells])  # not cells of an earlier file
            session.say(paths.verdicts_text)
            session.say(f"report: {paths.report}")
        except Exception as e:  # a report problem must not hide the cells' outcome
            session.say(f"report: failed ({type(e).__name__}: {e}); retry with `sweep report {session.sweep.name}`")
