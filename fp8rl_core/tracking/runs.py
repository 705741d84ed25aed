"""MLflow run management for the sweep driver: the experiment, one parent run per sweep, one child run
per cell, and the cells' states in one query.

    exp_id = ensure_experiment(uri, "fp8rl")                       # before any job is submitted
    parent = create_parent_run(uri, "fp8rl", "fp8_ablation", params=flat_sweep, config=sweep_dict)
    run_id, status = find_or_create_cell_run(uri, exp_id, parent, cell_id,
                                             tags={"recipe": "bf16", "importance_sampling": "none",
                                                   "seed": "0"}, params=cfg_dict, config=cfg_dict)
    if status != "FINISHED": submit(cell, run_id)                 # the job logs into run_id
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

import getpass
import hashlib
import json
import os
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Mapping

import yaml
from mlflow import MlflowClient
from mlflow.entities import Param, RunTag, ViewType
from mlflow.exceptions import MlflowException

from fp8rl_core.schema import flatten
from fp8rl_core.tracking import TAG_CELL_ID, TAG_PARENT, TAG_ROLE, TAG_SWEEP

MAX_KEY_LEN = 250
MAX_PARAM_VALUE_LEN = 6000
MAX_TAG_VALUE_LEN = 8000
MAX_PARAMS_PER_BATCH = 100
STATUS_RANK = {"FINISHED": 5, "RUNNING": 4, "SCHEDULED": 3, "FAILED": 2, "KILLED": 1}
_REPO_ROOT = Path(__file__).resolve().parents[2]
# MLflow 3's UI opens an experiment of this kind on its "Model training" views (runs table, charts)
# rather than on the GenAI traces overview.
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}


def default_artifact_location(uri: str) -> str | None:
    """`sqlite:///dir/mlflow.db` -> `file:///dir/mlartifacts` (artifacts beside the database, not
    in MLflow's cwd-relative `./mlruns`); None for other stores (the server decides)."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri.removeprefix("sqlite:///"))
    return (db.resolve().parent / "mlartifacts").as_uri()


def ensure_experiment(uri: str, name: str, artifact_location: str | None = None) -> str:
    """Return the id of experiment `name`, creating it (race-safe) when missing."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location or default_artifact_location(uri), EXPERIMENT_TAGS)
        except MlflowException as e:  # another process created it between our two calls
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise e
    if exp.lifecycle_stage == "deleted":
        raise ValueError(f"experiment {name!r} (id {exp.experiment_id}) is deleted in {uri}; restore it "
                         f"(`mlflow experiments restore --experiment-id {exp.experiment_id}`) or choose another name")
    return exp.experiment_id


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_REPO_ROOT), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def slurm_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """`<array job>_<task>` for an array task, else `SLURM_JOB_ID`, else None."""
    env = os.environ if env is None else env
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID") or None


def context_tags(git: bool = True) -> dict[str, str]:
    """Where and from what code this process runs: host, user, git commit, SLURM job id."""
    tags = {"host": socket.gethostname()}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry inside some containers
        pass
    if git:
        commit = _git("rev-parse", "HEAD")
        if commit:
            tags["mlflow.source.git.commit"] = tags["git_commit"] = commit
            tags["git_dirty"] = str(bool(_git("status", "--porcelain", "--untracked-files=no")))
    job = slurm_job_id()
    if job:
        tags["slurm_job_id"] = job
    return tags


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str) if isinstance(value, (list, tuple)) else str(value)
    if len(text) > MAX_PARAM_VALUE_LEN:
        mark = "...[truncated]"
        text = text[: MAX_PARAM_VALUE_LEN - len(mark)] + mark
    return text


def _param_key(key: str) -> str:
    if len(key) <= MAX_KEY_LEN:
        return key
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]  # keeps two long keys apart
    return f"{key[: MAX_KEY_LEN - 9]}~{digest}"


def flatten_params(config: Mapping[str, Any]) -> dict[str, str]:
    """Nested config -> `{"a.b": "value"}` within MLflow's limits (lists as JSON, None as 'None')."""
    return {_param_key(k): _param_text(v) for k, v in flatten(dict(config)).items()}


def log_params(client: MlflowClient, run_id: str, params: Mapping[str, Any]) -> None:
    """Flatten and log `params` in batches of <= 100 (MLflow's per-request limit)."""
    items = [Param(k, v) for k, v in flatten_params(params).items()]
    for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i : i + MAX_PARAMS_PER_BATCH], synchronous=True)


def set_tags(client: MlflowClient, run_id: str, tags: Mapping[str, Any]) -> None:
    items = [RunTag(k, str(v)[:MAX_TAG_VALUE_LEN]) for k, v in tags.items()]
    for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=items[i : i + MAX_PARAMS_PER_BATCH], synchronous=True)


def log_config_artifact(client: MlflowClient, run_id: str, config: Mapping[str, Any], name: str = "config.yaml") -> None:
    """The full (untruncated) config as a YAML artifact at the run's artifact root."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
        client.log_artifact(run_id, str(path))


def _quoted(key: str, value: str) -> str:
    if "'" in value or "\\" in value:
        raise ValueError(f"{key}: {value!r} may not contain quotes or backslashes (used in MLflow searches)")
    return f"'{value}'"


def _search(client: MlflowClient, experiment_ids: list[str], filter_string: str, order_by: list[str] | None = None):
    """All active runs matching the filter (one query; further pages only past 50000 runs)."""
    runs, token = [], None
    while True:
        page = client.search_runs(experiment_ids, filter_string, ViewType.ACTIVE_ONLY, 50000, order_by, token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _experiment_id(client: MlflowClient, experiment: str) -> str | None:
    exp = client.get_experiment_by_name(experiment)
    return exp.experiment_id if exp is not None else None


def find_parent_run(uri: str, experiment: str, sweep_name: str) -> str | None:
    """The newest active parent run of `sweep_name` in experiment `experiment` (a name), or None."""
    client = MlflowClient(uri)
    exp_id = _experiment_id(client, experiment)
    if exp_id is None:
        return None
    filt = f"tags.{TAG_SWEEP} = {_quoted('sweep', sweep_name)} and tags.`{TAG_ROLE}` = 'sweep'"
    runs = _search(client, [exp_id], filt, ["attributes.start_time DESC"])
    return runs[0].info.run_id if runs else None


def _new_run(client: MlflowClient, exp_id: str, run_name: str | None, tags: Mapping[str, Any],
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
    _quoted("sweep", sweep_name)
    existing = find_parent_run(uri, experiment, sweep_name)
    if existing:
        return existing
    exp_id = ensure_experiment(uri, experiment)
    all_tags = {**context_tags(), **(tags or {}), TAG_SWEEP: sweep_name, TAG_ROLE: "sweep"}
    return _new_run(MlflowClient(uri), exp_id, sweep_name, all_tags, params, config, "sweep.yaml")


def _cell_run_name(cell_id: str, tags: Mapping[str, Any]) -> str:
    parts = [str(tags[k]) for k in ("recipe", "importance_sampling") if k in tags]
    if "seed" in tags:
        parts.append(f"s{tags['seed']}")
    return "-".join(parts + [cell_id[:8]])


def find_or_create_cell_run(uri: str, experiment_id: str, parent_run_id: str, cell_id: str,
                            tags: Mapping[str, Any] | None = None, params: Mapping[str, Any] | None = None,
                            config: Mapping[str, Any] | None = None, run_name: str | None = None) -> tuple[str, str]:
    """`(run_id, status)` of the cell's child run under `parent_run_id`; a new run is SCHEDULED.

    New runs get tags `mlflow.parentRunId`, `cell_id`, `fp8rl.role=cell`, `sweep` (copied from the
    parent), context tags and `tags` (recipe, importance_sampling, seed, ...); `params` flattened;
    `config` as `config.yaml`. An existing run is returned as it is (nothing re-logged).
    """
    client = MlflowClient(uri)
    filt = (f"tags.`{TAG_PARENT}` = {_quoted('parent_run_id', parent_run_id)} "
            f"and tags.{TAG_CELL_ID} = {_quoted('cell_id', cell_id)}")
    found = _search(client, [experiment_id], filt)
    if found:
        best = max(found, key=lambda r: (STATUS_RANK.get(r.info.status, 0), r.info.start_time or 0))
        return best.info.run_id, best.info.status
    sweep = client.get_run(parent_run_id).data.tags.get(TAG_SWEEP, "")
    all_tags = {**context_tags(), **(tags or {}), TAG_PARENT: parent_run_id, TAG_CELL_ID: cell_id,
                TAG_ROLE: "cell", TAG_SWEEP: sweep}
    run_id = _new_run(client, experiment_id, run_name or _cell_run_name(cell_id, all_tags), all_tags, params,
                      config, "config.yaml")
    client.update_run(run_id, status="SCHEDULED")  # RUNNING once its job opens the sink
    return run_id, "SCHEDULED"


def cell_states(uri: str, experiment: str, sweep_name: str) -> dict[str, str]:
    """`{cell_id: status}` for every active child run of the sweep, from ONE search query."""
    client = MlflowClient(uri)
    exp_id = _experiment_id(client, experiment)
    if exp_id is None:
        return {}
    filt = f"tags.{TAG_SWEEP} = {_quoted('sweep', sweep_name)} and tags.`{TAG_ROLE}` = 'cell'"
    states: dict[str, str] = {}
    for run in _search(client, [exp_id], filt):
        cell = run.data.tags.get(TAG_CELL_ID)
        if cell and STATUS_RANK.get(run.info.status, 0) > STATUS_RANK.get(states.get(cell, ""), -1):
            states[cell] = run.info.status
    return states


def finish_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    """Mark a run terminated (the driver does this for the parent run at the end of a sweep)."""
    if status not in ("FINISHED", "FAILED", "KILLED"):
        raise ValueError(f"status: {status!r} not allowed; valid: FINISHED, FAILED, KILLED")
    MlflowClient(uri).set_terminated(run_id, status)


def create_run(uri: str, experiment: str, run_name: str | None = None, tags: Mapping[str, Any] | None = None,
               params: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None) -> str:
    """A standalone run (no sweep), for a single `fp8rl-train` with a tracking URI."""
    exp_id = ensure_experiment(uri, experiment)
    return _new_run(MlflowClient(uri), exp_id, run_name, {**context_tags(), **(tags or {})}, params, config,
                    "config.yaml")
