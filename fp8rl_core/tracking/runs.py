"""The MLflow runs, managed here: the experiment, one parent run per sweep, one child run per cell,
their status writes, and the cells' states in one query. Which status an outcome gets is decided in
`lifecycle.py` (the one table), which writes through this module; the one status write is
`store.set_status`; every MLflow call goes through `store.Store`.

    exp_id = ensure_experiment(uri, "fp8rl")                       # before any job is submitted
    parent = create_parent_run(uri, "fp8rl", "fp8_ablation", params=flat_sweep, config=sweep_dict)
    run_id, status = find_or_create_cell_run(uri, exp_id, parent, cell_id,
                                             tags={"recipe": "bf16", "importance_sampling": "none",
                                                   "seed": "0"}, params=cfg_dict, config=cfg_dict)
    if status != "FINISHED": submit(cell, run_id)                 # the job logs into run_id
    start_run(uri, run_id)                                         # RUNNING (a requeued job goes on)
    end_run(uri, run_id, "KILLED", buffer_path=out / "metrics.jsonl")   # ships what the cell logged, then ends
    states = cell_states(uri, "fp8rl", "fp8_ablation")             # {cell_id: "FINISHED", ...}
    finish_run(uri, parent, "FINISHED")

Statuses are MLflow's: SCHEDULED (created, not started: a new cell run), RUNNING (a job opened its
sink), FINISHED, FAILED, KILLED. Runs deleted in the UI are ignored (a deleted cell runs again).
Idempotent: `create_parent_run` returns the sweep's existing parent run, `find_or_create_cell_run`
the cell's existing run, so `sweep run` can be repeated. One driver per sweep is assumed (two
drivers creating the same cell at the same instant would make two runs; `cell_states` then reports
the best status: FINISHED > RUNNING > SCHEDULED > FAILED > KILLED).

Params are flattened (`a.b.c`), keys <= 250 chars, values <= 6000 chars (MLflow's limits; longer
values are truncated, the full config is the `config.yaml` artifact), logged <= 100 per `log_batch`.
Tags: `sweep`, `fp8rl.role`, `mlflow.source.git.commit` (shown by the UI), `git_commit`, `git_dirty`,
`host`, `mlflow.user`, and `slurm_job_id` when SLURM env vars are set.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fp8rl_core.tracking.contract import (
    EXPERIMENT_TAGS,
    FINISHED,
    ROLE_CELL,
    ROLE_SWEEP,
    RUNNING,
    SCHEDULED,
    STATUS_RANK,
    TAG_CELL_ID,
    TAG_ERROR,
    TAG_IS,
    TAG_PARENT,
    TAG_RECIPE,
    TAG_ROLE,
    TAG_SEED,
    TAG_SWEEP,
)
from fp8rl_core.tracking.mlflow_sink import replay_buffer
from fp8rl_core.tracking.store import (  # noqa: F401  (flatten_params, context_tags, ...: this module's API too)
    END_STATUSES,
    MAX_KEY_LEN,
    MAX_PARAM_VALUE_LEN,
    MAX_PARAMS_PER_BATCH,
    MAX_TAG_VALUE_LEN,
    OPEN_STATUSES,
    Store,
    TrackingUnreachable,
    context_tags,
    default_artifact_location,
    flatten_params,
    log_config_artifact,
    log_params,
    mlflow_error,
    retry_locked,
    set_status,
    set_tags,
    slurm_job_id,
    tracking_reachable,
)

log = logging.getLogger(__name__)

ERROR_TAG = TAG_ERROR  # the exception that ended a failed cell (tracking.contract)


def ensure_experiment(uri: str, name: str, artifact_location: str | None = None) -> str:
    """Return the id of experiment `name`, creating it (race-safe) when missing."""
    client = Store(uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location or default_artifact_location(uri), EXPERIMENT_TAGS)
        except mlflow_error() as e:  # another process created it between our two calls
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise e
    if exp.lifecycle_stage == "deleted":
        raise ValueError(f"experiment {name!r} (id {exp.experiment_id}) is deleted in {uri}; restore it "
                         f"(`mlflow experiments restore --experiment-id {exp.experiment_id}`) or choose another name")
    return exp.experiment_id


def _quoted(key: str, value: str) -> str:
    if "'" in value or "\\" in value:
        raise ValueError(f"{key}: {value!r} may not contain quotes or backslashes (used in MLflow searches)")
    return f"'{value}'"


def find_parent_run(uri: str, experiment: str, sweep_name: str) -> str | None:
    """The newest active parent run of `sweep_name` in experiment `experiment` (a name), or None."""
    client = Store(uri)
    exp_id = client.experiment_id(experiment)
    if exp_id is None:
        return None
    filt = f"tags.{TAG_SWEEP} = {_quoted(TAG_SWEEP, sweep_name)} and tags.`{TAG_ROLE}` = '{ROLE_SWEEP}'"
    runs = client.search_runs([exp_id], filt, ["attributes.start_time DESC"])
    return runs[0].info.run_id if runs else None


def _new_run(client: Store, exp_id: str, run_name: str | None, tags: Mapping[str, Any],
             params: Mapping[str, Any] | None, config: Mapping[str, Any] | None, config_name: str) -> str:
    run = client.create_run(exp_id, run_name=run_name, tags={k: str(v)[:MAX_TAG_VALUE_LEN] for k, v in tags.items()})
    run_id = run.info.run_id
    if params:
        log_params(client, run_id, params)
    if config is not None:
        log_config_artifact(client, run_id, config, config_name)
    return run_id


def create_parent_run(uri: str, experiment: str, sweep_name: str, tags: Mapping[str, Any] | None = None,
                      params: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None) -> str:
    """The sweep's parent run id: the existing one, else a new one (experiment created if needed).

    `config` (the sweep file as a dict) becomes the `sweep.yaml` artifact; `params` are flattened.
    """
    _quoted(TAG_SWEEP, sweep_name)
    existing = find_parent_run(uri, experiment, sweep_name)
    if existing:
        return existing
    exp_id = ensure_experiment(uri, experiment)
    all_tags = {**context_tags(), **(tags or {}), TAG_SWEEP: sweep_name, TAG_ROLE: ROLE_SWEEP}
    return _new_run(Store(uri), exp_id, sweep_name, all_tags, params, config, "sweep.yaml")


def _cell_run_name(cell_id: str, tags: Mapping[str, Any]) -> str:
    parts = [str(tags[k]) for k in (TAG_RECIPE, TAG_IS) if k in tags]
    if TAG_SEED in tags:
        parts.append(f"s{tags[TAG_SEED]}")
    return "-".join(parts + [cell_id[:8]])


def find_or_create_cell_run(uri: str, experiment_id: str, parent_run_id: str, cell_id: str,
                            tags: Mapping[str, Any] | None = None, params: Mapping[str, Any] | None = None,
                            config: Mapping[str, Any] | None = None, run_name: str | None = None) -> tuple[str, str]:
    """`(run_id, status)` of the cell's child run under `parent_run_id`; a new run is SCHEDULED.

    New runs get tags `mlflow.parentRunId`, `cell_id`, `fp8rl.role=cell`, `sweep` (copied from the
    parent), context tags and `tags` (recipe, importance_sampling, seed, ...); `params` flattened;
    `config` as `config.yaml`. An existing run is returned as it is, except that params it lacks are
    logged: a driver killed between creating the run and logging its params (or mid-batch) left them
    out, and the job no longer logs them (params are written once, by the driver).
    """
    client = Store(uri)
    filt = (f"tags.`{TAG_PARENT}` = {_quoted('parent_run_id', parent_run_id)} "
            f"and tags.{TAG_CELL_ID} = {_quoted(TAG_CELL_ID, cell_id)}")
    found = client.search_runs([experiment_id], filt)
    if found:
        best = max(found, key=lambda r: (STATUS_RANK.get(r.info.status, 0), r.info.start_time or 0))
        missing = {k: v for k, v in flatten_params(params or {}).items() if k not in best.data.params}
        if missing:
            log_params(client, best.info.run_id, missing)
        return best.info.run_id, best.info.status
    sweep = client.get_run(parent_run_id).data.tags.get(TAG_SWEEP, "")
    all_tags = {**context_tags(), **(tags or {}), TAG_PARENT: parent_run_id, TAG_CELL_ID: cell_id,
                TAG_ROLE: ROLE_CELL, TAG_SWEEP: sweep}
    run_id = _new_run(client, experiment_id, run_name or _cell_run_name(cell_id, all_tags), all_tags, params,
                      config, "config.yaml")
    client.update_run(run_id, status=SCHEDULED)  # RUNNING once its job opens the sink
    return run_id, SCHEDULED


def cell_states(uri: str, experiment: str, sweep_name: str) -> dict[str, str]:
    """`{cell_id: status}` for every active child run of the sweep, from ONE search query."""
    client = Store(uri)
    exp_id = client.experiment_id(experiment)
    if exp_id is None:
        return {}
    filt = f"tags.{TAG_SWEEP} = {_quoted(TAG_SWEEP, sweep_name)} and tags.`{TAG_ROLE}` = '{ROLE_CELL}'"
    states: dict[str, str] = {}
    for run in client.search_runs([exp_id], filt):
        cell = run.data.tags.get(TAG_CELL_ID)
        if cell and STATUS_RANK.get(run.info.status, 0) > STATUS_RANK.get(states.get(cell, ""), -1):
            states[cell] = run.info.status
    return states


def run_statuses(uri: str, experiment: str, run_ids: list[str]) -> dict[str, str]:
    """`{run_id: status}` of the given active runs of `experiment` (a name), from ONE search query:
    `sweep cancel` reads its cells' runs before and after it signals their jobs (not one get_run each)."""
    if not run_ids:
        return {}
    client = Store(uri)
    exp_id = client.experiment_id(experiment)
    if exp_id is None:
        return {}
    ids = ", ".join(_quoted("run_id", r) for r in sorted(set(run_ids)))
    return {run.info.run_id: run.info.status for run in client.search_runs([exp_id], f"attributes.run_id IN ({ids})")}


def start_run(uri: str, run_id: str) -> None:
    """A job started (or a requeued job goes on): RUNNING, unless the run already FINISHED."""
    client = Store(uri)
    if client.get_run(run_id).info.status != FINISHED:
        set_status(client, run_id, RUNNING)


def end_run(uri: str, run_id: str, status: str, buffer_path: str | Path | None = None, error: str | None = None,
            only_open: bool = True, ship_timeout_s: float = 60.0) -> bool:
    """End a run as `status` (FINISHED, FAILED, KILLED); True when this call set it.

    `buffer_path` (the cell's metrics.jsonl): its records MLflow has not acknowledged are shipped
    FIRST, so a killed or failed cell keeps every step it logged. `error`: the exception text,
    tagged `fp8rl.error`. `only_open`: leave a run that already ended (or never should: FINISHED) as it is.
    """
    if status not in END_STATUSES:
        raise ValueError(f"status: {status!r} not allowed; valid: {', '.join(END_STATUSES)}")
    if buffer_path is not None and Path(buffer_path).exists():
        try:
            replay_buffer(uri, run_id, buffer_path, timeout_s=ship_timeout_s)
        except ValueError as e:  # the buffer belongs to another run: never ship it here
            log.warning("run %s: %s", run_id, e)
    client = Store(uri)
    if error:
        retry_locked(client.set_tag, run_id, ERROR_TAG, error[:MAX_TAG_VALUE_LEN // 2])
    if only_open and retry_locked(client.get_run, run_id).info.status not in OPEN_STATUSES:
        return False
    retry_locked(set_status, client, run_id, status)
    return True


def finish_run(uri: str, run_id: str, status: str = FINISHED) -> None:
    """End a sweep's parent run (whatever its status was)."""
    end_run(uri, run_id, status, only_open=False)


def last_metric(uri: str, run_id: str, key: str) -> float | None:
    """The last logged value of metric `key` in the run (None if never logged)."""
    return retry_locked(Store(uri).get_run, run_id).data.metrics.get(key)


def log_summary(uri: str, run_id: str, metrics: Mapping[str, float], tags: Mapping[str, Any]) -> None:
    """Summary metrics and tags on a (parent) run, e.g. an Optuna search's best trial."""
    client = Store(uri)
    for key, value in metrics.items():
        retry_locked(client.log_metric, run_id, key, value)
    for key, value in tags.items():
        retry_locked(client.set_tag, run_id, key, str(value)[:MAX_TAG_VALUE_LEN])


def create_run(uri: str, experiment: str, run_name: str | None = None, tags: Mapping[str, Any] | None = None,
               params: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None) -> str:
    """A standalone run (no sweep), for a single `fp8rl-train` with a tracking URI."""
    exp_id = ensure_experiment(uri, experiment)
    return _new_run(Store(uri), exp_id, run_name, {**context_tags(), **(tags or {})}, params, config,
                    "config.yaml")
