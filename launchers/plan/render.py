"""`sweep plan`: what a sweep would do, as text. Nothing is launched, and nothing is written.

The cells (id, varied values, state, action) and their counts, then for SLURM the sbatch script that
would be submitted. A cell's state comes from a StateProvider (cell ids -> state); the MLflow one
plugs in here (`launchers.cli.STATE_PROVIDER`); an id missing from its answer is a new cell.
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

from fp8rl_core.tracking.store import sqlite_path
from launchers.executors.slurm.sbatch import render_sbatch, slurm_submission
from launchers.plan import rules
from launchers.plan.cells import Cell
from launchers.plan.grid import Expansion
from launchers.plan.memory import CellMemory
from launchers.sweepfile import search_space
from launchers.sweepfile.loading import Sweep

StateProvider = Callable[[list[str]], dict[str, str]]
DEFAULT_MAX_ROWS = 200


def default_state_provider(sweep: Sweep) -> StateProvider:
    """States without reading the tracking store (opening it could create it): every cell is `new`
    when the store is a sqlite file that does not exist yet, else `unknown`."""
    db = sqlite_path(sweep.tracking_uri())
    state = "new" if db is not None and not db.exists() else "unknown"
    return lambda ids: {i: state for i in ids}


def action_for(state: str) -> str:
    """`sweep plan`'s action column: the rules table's word for the state (launchers.plan.rules)."""
    return rules.plan_word(state)


def fmt(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (bool, type(None), list, tuple, dict)):
        return json.dumps(value, separators=(",", ":"))
    return repr(value)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]


def _header(sweep: Sweep) -> list[str]:
    la = sweep.launcher
    lines = [f"sweep {sweep.experiment} ({sweep.name})"]
    if sweep.overrides:
        lines.append("  overrides: " + " ".join(sweep.overrides))
    lines.append(f"  launcher: {la.kind}, max_parallel {la.max_parallel}, retries {la.retries}, "
                 f"{la.world_size} rank(s) per cell; folder {sweep.folder_label}")
    lines.append(f"  tracking: {sweep.spec.tracking.uri}")
    return lines


def render_grid(sweep: Sweep, expansion: Expansion, states: dict[str, str], max_rows: int | None,
                memory: dict[str, CellMemory] | None = None) -> str:
    """`memory`: cell id -> its memory plan (launchers.plan.memory), shown as peak GiB per rank
    (/ what a rank has, when the cell requests it); `world_size`: the cell's ranks."""
    cells = expansion.cells
    lines = _header(sweep)
    lines.append(f"  cells: {len(cells)} ({expansion.combinations} combinations, {expansion.excluded} excluded)")
    keys = list(cells[0].params)
    rows = [["id", *keys, "world_size", "mem/rank", "state", "action"]]
    shown = cells if max_rows is None else cells[:max_rows]
    for cell in shown:
        state = states.get(cell.id, "new")
        mem = memory[cell.id].label() + (" REFUSED" if memory[cell.id].refused else "") if memory else "-"
        rows.append([cell.id, *(fmt(cell.params[k]) for k in keys), str(sweep.launcher.world_size), mem, state,
                     action_for(state)])
    lines += ["", *_table(rows)]
    unknown = [m for m in (memory or {}).values() if m.peak is None]
    if unknown:
        lines.append(f"mem/rank ?: {len(unknown)} cell(s) not estimated ({unknown[0].why})")
    if len(shown) < len(cells):
        lines.append(f"... and {len(cells) - len(shown)} more cells (sweep plan FILE --all)")
    actions = Counter(action_for(states.get(c.id, "new")) for c in cells)
    counts = Counter(states.get(c.id, "new") for c in cells)
    lines += ["", "actions: " + ", ".join(f"{a} {n}" for a, n in sorted(actions.items()))
              + " | states: " + ", ".join(f"{s} {n}" for s, n in sorted(counts.items()))]
    return "\n".join(lines + _sbatch_section(sweep, len(cells_to_run(cells, states)))) + "\n"


def render_search(sweep: Sweep) -> str:
    search = sweep.spec.search
    assert search is not None
    n = search_space.n_trials(search)
    storage = search.storage or f"{sweep.folder_label}/{search_space.JOURNAL_NAME}"
    lines = _header(sweep) + [
        f"  search: {search.sampler} sampler, {n} trials, {search.parallel} at once, "
        f"{search.direction} {search.metric}, retries {search.retries}",
        f"  storage: {storage if '://' in storage else 'journal ' + storage}", "",
        *_table([["param", "range"]] + [[k, search_space.describe(p)] for k, p in search.params.items()]),
        "", "trials become cells as Optuna suggests them (sweep run); their ids are known only then"]
    return "\n".join(lines + _sbatch_section(sweep, min(search.parallel, n))) + "\n"


def _sbatch_section(sweep: Sweep, n_tasks: int) -> list[str]:
    if sweep.launcher.kind != "slurm":
        return []
    if n_tasks == 0:
        return ["", "nothing to submit"]
    what = f"1 array of {n_tasks} tasks, at most {sweep.launcher.max_parallel} at once" if n_tasks > 1 else "1 job"
    return ["", f"sbatch script ({what}):", render_sbatch(slurm_submission(sweep), n_tasks).rstrip("\n")]


def render_plan(sweep: Sweep, expansion: Expansion | None, provider: StateProvider | None = None,
                max_rows: int | None = DEFAULT_MAX_ROWS, memory: dict[str, CellMemory] | None = None) -> str:
    """The whole `sweep plan` text (a search sweep has no expansion: pass None)."""
    if sweep.spec.search is not None or expansion is None:
        return render_search(sweep)
    provider = provider or default_state_provider(sweep)
    states = provider([c.id for c in expansion.cells])
    if memory is None:
        from launchers.plan.memory import plan_cells

        memory = plan_cells(sweep, expansion.cells)
    return render_grid(sweep, expansion, states, max_rows, memory)


def cells_to_run(cells: list[Cell], states: dict[str, str]) -> list[Cell]:
    """The cells `sweep run` would launch: new, unknown, failed or killed ones."""
    return [c for c in cells if rules.action_of(states.get(c.id, "new")) == rules.RUN]
