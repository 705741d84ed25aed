"""`sweep status FILE [--watch]`: every cell's state, step and (when it failed) error, from any shell.

One MLflow query (`cell_states`), one scheduler poll for all jobs on record (one `sacct`), and each
running cell's `metrics.jsonl` tail. Nothing is written. Also the MLflow-backed state provider
of `sweep plan` (`plan_states`).
"""
from __future__ import annotations

import copy
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from launchers import survey
from launchers.cells import CELLS_SUBFOLDER, Cell
from launchers.plan import StateProvider, default_state_provider, fmt
from launchers.progress import cell_step, error_tail, eta_seconds, fmt_duration
from launchers.state import CellRecord, SweepState, is_locked, load_state
from launchers.sweep_file import Sweep

ERROR_WIDTH = 160


def store_exists(sweep: Sweep) -> bool:
    """False for a SQLite store without MLflow's tables yet: opening it would create them, and
    status and plan only read. Checked with SQLite itself, read-only."""
    uri = sweep.tracking_uri()
    if not uri.startswith("sqlite:///"):
        return True
    path = Path(uri[len("sqlite:///"):])
    if not path.exists():
        return False
    import sqlite3

    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=10)
        try:
            return con.execute("SELECT 1 FROM sqlite_master WHERE name = 'experiments'").fetchone() is not None
        finally:
            con.close()
    except sqlite3.Error:
        return False


def mlflow_states(sweep: Sweep) -> dict[str, str]:
    """The cells' MLflow statuses ({} for a store not created yet); TrackingUnreachable when an
    http(s) server does not answer."""
    if not store_exists(sweep):
        return {}
    if not survey.tracking_reachable(sweep.tracking_uri()):
        raise survey.TrackingUnreachable(f"the tracking server {sweep.tracking_uri()} does not answer (/health); "
                                  f"start it (`sweep server`) or check tracking.uri")
    from fp8rl_core.tracking.runs import cell_states

    return survey.retry_locked(cell_states, sweep.tracking_uri(), sweep.experiment, sweep.experiment)


def sweep_cells(sweep: Sweep, state: SweepState | None) -> list[Cell]:
    """Grid cells; for a search, the trials on record (their params are kept in the state)."""
    if sweep.spec.search is None:
        from launchers.grid import expand

        return expand(sweep)
    from launchers.grid import cell_for

    recs = state.cells.items() if state else []
    return [cell_for(sweep, rec.params, i) for i, (_, rec) in enumerate(recs) if rec.params is not None]


def plan_states(sweep: Sweep) -> StateProvider:
    """`sweep plan`'s states: MLflow status (lower case), `exhausted` for cells out of retries,
    `new` for cells without a run. Reads only; no scheduler poll (a plan is a dry run)."""
    try:
        mlflow = mlflow_states(sweep)
    except survey.TrackingUnreachable as e:
        print(f"warning: {e}; states shown as unknown", file=sys.stderr)
        return default_state_provider(sweep)
    if not mlflow and not store_exists(sweep):
        return default_state_provider(sweep)
    state = load_state(sweep.folder)

    def provider(ids: list[str]) -> dict[str, str]:
        out = {}
        for i in ids:
            rec = state.cells.get(i) if state else None
            status = mlflow.get(i)
            if status != "FINISHED" and rec is not None and rec.failures() > sweep.launcher.retries:
                out[i] = "exhausted"
            else:
                out[i] = status.lower() if status else "new"
        return out
    return provider


def collect(sweep: Sweep) -> tuple[list[Cell], list[dict[str, Any]], SweepState | None]:
    """One row per cell: id, params, state, step, job, error."""
    state = load_state(sweep.folder)
    cells = sweep_cells(sweep, state)
    jobs: dict[str, str] = {}
    if state is not None:  # the scheduler first: a job seen ended has written its run's final status
        from launchers.cancel import _executors

        jobs = survey.poll_attempts(state.open_attempts(), _executors(sweep))
    mlflow = mlflow_states(sweep)
    rows = []
    for cell in cells:
        rec = copy.deepcopy(state.cells.get(cell.id)) if state else None  # settled in memory only
        att = rec.open_attempt() if rec else None
        job_state = jobs.get(att.job_id) if att else None
        if rec is not None:
            survey.settle(rec, mlflow.get(cell.id), job_state)
        shown = survey.display_state(mlflow.get(cell.id), rec, job_state, sweep.launcher.retries)
        step = cell_step(sweep.folder / CELLS_SUBFOLDER / cell.id)
        rows.append({"cell": cell, "state": shown, "step": step, "job": att.job_id if att else
                     (rec.last().job_id if rec and rec.last() else ""), "error": _error(rec, shown)})
    return cells, rows, state


def _error(rec: CellRecord | None, shown: str) -> str:
    if shown not in ("failed", "killed", "exhausted") or rec is None or rec.last() is None:
        return ""
    last = rec.last()
    return last.error or error_tail(last.stderr) or ""


def render(sweep: Sweep, cells: list[Cell], rows: list[dict[str, Any]], state: SweepState | None) -> str:
    keys = list(cells[0].params) if cells else []
    table = [["id", *keys, "state", "step", "job", "error"]]
    for r in rows:
        c = r["cell"]
        step = f"{max(r['step'].step, 0)}/{c.config.train.steps}" if r["step"].step >= 0 else "-"
        err = r["error"][-ERROR_WIDTH:]
        table.append([c.id, *(fmt(c.params[k]) for k in keys), r["state"], step, r["job"] or "-", err])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row[:-1], widths)) + "  " + row[-1] for row in table]
    counts = Counter(r["state"] for r in rows)
    active = [r for r in rows if r["state"] in ("pending", "running")]
    remaining = sum(r["cell"].config.train.steps - max(0, r["step"].step) for r in active)
    eta = eta_seconds(remaining, [r["step"].seconds_per_step() for r in active], sweep.launcher.max_parallel)
    driver = "running" if is_locked(sweep.folder) else "not running"
    head = (f"sweep {sweep.experiment}: {len(rows)} cells: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            + (f" | ETA {fmt_duration(eta)}" if active else "") + f" | driver {driver}")
    if state is None:
        head += f" | never run from {sweep.folder}"
    return "\n".join([head, "", *(ln.rstrip() for ln in lines)]) + "\n"


def sweep_status(sweep: Sweep, out: TextIO | None = None, watch: bool = False, interval_s: float = 5.0) -> int:
    out = out or sys.stdout
    while True:
        cells, rows, state = collect(sweep)
        text = render(sweep, cells, rows, state)
        if watch and out.isatty():
            out.write("\x1b[H\x1b[2J")  # clear the screen: the table redraws in place
        out.write(text)
        out.flush()
        busy = any(r["state"] in ("pending", "running") for r in rows) or is_locked(sweep.folder)
        if not watch or not busy:
            return 0
        time.sleep(interval_s)
        if not out.isatty():
            out.write("\n")
