"""`sweep status FILE [--watch]`: every cell's state, step and (when it failed) error, from any shell;
and the states `sweep plan` shows.

One scheduler poll for all jobs on record (one `sacct`), one MLflow query (`cell_states`), and each
running cell's `metrics.jsonl` tail; the state of each cell from the one rules table
(launchers.plan.rules.cell_state), settled in memory only. Nothing is written. `plan_states` is the
same survey for `sweep plan`, so plan and run agree (a RUNNING cell whose job is dead: `killed`,
action rerun, in both).
"""
from __future__ import annotations

import copy
import sys
import time
from collections import Counter
from typing import Any, TextIO

from fp8rl_core.tracking.runs import cell_states
from fp8rl_core.tracking.store import TrackingUnreachable, retry_locked, store_exists, tracking_reachable
from launchers.executors import Executors, poll_by_kind
from launchers.plan import rules
from launchers.plan.cells import CELLS_SUBFOLDER, Cell
from launchers.plan.render import StateProvider, default_state_provider, fmt
from launchers.run.cell_facts import handle_of, settle
from launchers.run.progress import cell_step, error_tail, eta_seconds, fmt_duration
from launchers.run.state import CellRecord, SweepState, is_locked, load_state
from launchers.sweepfile.loading import Sweep

ERROR_WIDTH = 160


def mlflow_states(sweep: Sweep) -> dict[str, str]:
    """The cells' MLflow statuses ({} for a store not created yet); TrackingUnreachable when an
    http(s) server does not answer."""
    uri = sweep.tracking_uri()
    if not store_exists(uri):
        return {}
    if not tracking_reachable(uri):
        raise TrackingUnreachable(f"the tracking server {uri} does not answer (/health); "
                                  f"start it (`sweep server`) or check tracking.uri")
    return retry_locked(cell_states, uri, sweep.experiment, sweep.experiment)


def sweep_cells(sweep: Sweep, state: SweepState | None) -> list[Cell]:
    """Grid cells; for a search, the trials on record (their params are kept in the state)."""
    if sweep.spec.search is None:
        from launchers.plan.grid import expand

        return expand(sweep)
    from launchers.plan.grid import cell_for

    recs = state.cells.items() if state else []
    return [cell_for(sweep, rec.params, i) for i, (_, rec) in enumerate(recs) if rec.params is not None]


def survey(sweep: Sweep, cell_ids: list[str], state: SweepState | None
           ) -> dict[str, tuple[str, CellRecord | None, str | None]]:
    """cell id -> (state, its record settled in memory, its open job id): one poll, then one MLflow
    query (in this order: a job seen ended has written its run's final status)."""
    jobs: dict[str, str] = {}
    if state is not None:
        jobs = poll_by_kind([handle_of(cid, att) for cid, att in state.open_attempts()], Executors(sweep))
    mlflow = mlflow_states(sweep)
    out = {}
    for cid in cell_ids:
        rec = copy.deepcopy(state.cells.get(cid)) if state else None  # settled in memory only
        att = rec.open_attempt() if rec else None
        job_state = jobs.get(att.job_id) if att else None
        if rec is not None:
            settle(rec, mlflow.get(cid), job_state)
        shown = rules.cell_state(mlflow.get(cid), rec, job_state, sweep.launcher.retries)
        out[cid] = (shown, rec, att.job_id if att and rules.action_of(shown) == rules.WAIT else None)
    return out


def plan_states(sweep: Sweep) -> StateProvider:
    """`sweep plan`'s states: the same survey as `sweep status` and `sweep run` (a scheduler poll and
    an MLflow query; both only read), `new` for every cell of a store not created yet."""
    try:
        if not mlflow_states(sweep) and not store_exists(sweep.tracking_uri()):
            return default_state_provider(sweep)
    except TrackingUnreachable as e:
        print(f"warning: {e}; states shown as unknown", file=sys.stderr)
        return default_state_provider(sweep)
    state = load_state(sweep.folder)

    def provider(ids: list[str]) -> dict[str, str]:
        try:
            return {cid: shown for cid, (shown, _, _) in survey(sweep, ids, state).items()}
        except (OSError, RuntimeError) as e:  # no scheduler here (sacct missing or failing): say so
            print(f"warning: cannot ask the scheduler ({e}); states shown as unknown", file=sys.stderr)
            return {i: "unknown" for i in ids}
    return provider


def collect(sweep: Sweep) -> tuple[list[Cell], list[dict[str, Any]], SweepState | None]:
    """One row per cell: id, params, state, step, job, error."""
    state = load_state(sweep.folder)
    cells = sweep_cells(sweep, state)
    found = survey(sweep, [c.id for c in cells], state)
    rows = []
    for cell in cells:
        shown, rec, job = found[cell.id]
        step = cell_step(sweep.folder / CELLS_SUBFOLDER / cell.id)
        rows.append({"cell": cell, "state": shown, "step": step, "job": job or
                     (rec.last().job_id if rec and rec.last() else ""), "error": _error(rec, shown)})
    return cells, rows, state


def _error(rec: CellRecord | None, shown: str) -> str:
    if shown not in ("failed", "killed", "exhausted") or rec is None or rec.last() is None:
        return ""
    last = rec.last()
    return last.error or error_tail(last.stderr) or ""


def render(sweep: Sweep, cells: list[Cell], rows: list[dict[str, Any]], state: SweepState | None) -> str:
    keys = list(cells[0].params) if cells else []
    table = [["id", *keys, "world_size", "state", "step", "job", "error"]]
    world = str(sweep.launcher.world_size)  # ranks per cell: nodes x tasks_per_node, or ranks_per_cell
    for r in rows:
        c = r["cell"]
        step = f"{max(r['step'].step, 0)}/{c.config.train.steps}" if r["step"].step >= 0 else "-"
        err = r["error"][-ERROR_WIDTH:]
        table.append([c.id, *(fmt(c.params[k]) for k in keys), world, r["state"], step, r["job"] or "-", err])
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
