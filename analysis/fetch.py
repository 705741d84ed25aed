"""Pull one sweep's child runs and their metric histories back out of MLflow (not from side files).

    data = fetch_sweep("sqlite:///mlflow.db", "fp8rl", sweep_name="fp8_ablation")
    run = data.runs[0]; steps, values = run.series("token_mult_prob_error")   # int64 [S], float64 [S]

Child runs are found with one search: by `mlflow.parentRunId` when `parent_run_id` is given, else by
the `sweep` tag (role `cell`). With `cell_ids` (the cells of the sweep file as it is now) only runs
whose `cell_id` tag is among them are kept: a parent run outlives edits of its sweep file, so runs of
cells the file no longer has (e.g. a `model.dtype` value since removed) are left out, and counted in
`SweepData.stale_runs`, before any history is read.
Histories come in bulk, one request per metric key, not per run (`fp8rl_core.tracking.store.Store.metric_histories`):
- SQL stores (sqlite, postgres, mysql): `SqlAlchemyStore.get_metric_history_bulk(run_ids, key)`;
- a tracking server: GET `/api/2.0/mlflow/metrics/get-history-bulk-interval` (<= 100 runs a call,
  <= 2500 points a run; the server samples longer histories, so a run that comes back with 2500
  points is re-read in full with `get_metric_history`);
- any other store: `get_metric_history` per run and key.
When a step holds several values (a run logged twice through some other client), the earliest
logged wins, as in `fp8rl_core.tracking.sink`.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from fp8rl_core.tracking import (
    ROLE_CELL,
    ROLE_SWEEP,
    TAG_CELL_ID,
    TAG_IS,
    TAG_PARENT,
    TAG_RECIPE,
    TAG_ROLE,
    TAG_SEED,
    TAG_SWEEP,
)
from fp8rl_core.tracking.store import Points, Store


@dataclass
class RunHistory:
    """One child run: its tags, params, status and per-key histories sorted by step."""

    run_id: str
    run_name: str
    status: str
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """`(steps int64 [S], values float64 [S])`, empty when the run never logged `key`."""
        return self.metrics.get(key, (np.zeros(0, np.int64), np.zeros(0, np.float64)))

    def get(self, key: str, default: str | None = None) -> str | None:
        """A grouping value: `tags.X` / `params.X` explicitly, or a bare name (tags first, then params)."""
        if key.startswith("tags."):
            return self.tags.get(key[5:], default)
        if key.startswith("params."):
            return self.params.get(key[7:], default)
        return self.tags.get(key, self.params.get(key, default))


@dataclass
class SweepData:
    uri: str
    experiment_id: str | None
    sweep_name: str | None
    parent_run_id: str | None
    runs: list[RunHistory]
    stale_runs: int = 0  # child runs left out: their cell_id is not a cell of the sweep file as it is now


def _points_to_arrays(points: Points) -> tuple[np.ndarray, np.ndarray]:
    first: dict[int, tuple[int, float]] = {}
    for step, ts, value in points:
        if step not in first or ts < first[step][0]:
            first[step] = (ts, value)
    steps = np.array(sorted(first), dtype=np.int64)
    return steps, np.array([first[s][1] for s in steps], dtype=np.float64)


def read_histories(store: Store, run_ids: Sequence[str], keys: Iterable[str]) -> dict[str, dict[str, tuple]]:
    """`{run_id: {key: (steps, values)}}` with one bulk request per key where the store allows it
    (`Store.metric_histories`)."""
    result: dict[str, dict[str, tuple]] = {r: {} for r in run_ids}
    for key in keys:
        points = store.metric_histories(list(run_ids), key)
        for run_id, pts in points.items():
            if pts and run_id in result:
                result[run_id][key] = _points_to_arrays(pts)
    return result


def _find_parent(store: Store, exp_id: str, sweep_name: str) -> str | None:
    runs = store.search_runs([exp_id], f"tags.{TAG_SWEEP} = '{sweep_name}' and tags.`{TAG_ROLE}` = '{ROLE_SWEEP}'",
                             ["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def fetch_sweep(uri: str, experiment: str, sweep_name: str | None = None, parent_run_id: str | None = None,
                keys: Sequence[str] | None = None, cell_ids: Collection[str] | None = None) -> SweepData:
    """Child runs of one sweep with their histories (`keys`: every metric the runs logged by default).
    `cell_ids`: keep only the runs of these cells (None: every child run); the rest are counted in
    `.stale_runs`."""
    if not sweep_name and not parent_run_id:
        raise ValueError("fetch_sweep: give sweep_name or parent_run_id")
    for name, value in (("sweep_name", sweep_name), ("parent_run_id", parent_run_id)):
        if value and ("'" in value or "\\" in value):
            raise ValueError(f"{name}: {value!r} may not contain quotes or backslashes")
    client = Store(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(f"experiment {experiment!r} not found in {uri}")
    exp_id = exp.experiment_id
    parent_run_id = parent_run_id or _find_parent(client, exp_id, sweep_name)
    filt = (f"tags.`{TAG_PARENT}` = '{parent_run_id}'" if parent_run_id
            else f"tags.{TAG_SWEEP} = '{sweep_name}' and tags.`{TAG_ROLE}` = '{ROLE_CELL}'")
    found = [r for r in client.search_runs([exp_id], filt) if TAG_CELL_ID in r.data.tags]
    stale = 0
    if cell_ids is not None:
        current = set(cell_ids)
        kept = [r for r in found if r.data.tags[TAG_CELL_ID] in current]
        found, stale = kept, len(found) - len(kept)
    keys = list(keys) if keys is not None else sorted({k for r in found for k in r.data.metrics})
    histories = read_histories(client, [r.info.run_id for r in found], keys)
    runs = [RunHistory(r.info.run_id, r.info.run_name, r.info.status, dict(r.data.tags), dict(r.data.params),
                       histories[r.info.run_id]) for r in found]
    runs.sort(key=lambda r: (r.tags.get(TAG_RECIPE, ""), r.tags.get(TAG_IS, ""), r.tags.get(TAG_SEED, "")))
    sweep_name = sweep_name or (runs[0].tags.get(TAG_SWEEP) if runs else None)
    return SweepData(uri, exp_id, sweep_name, parent_run_id, runs, stale)
