"""Tracking: where a run's metrics go (local JSONL always, MLflow when configured) and the MLflow
run management the sweep driver uses.

The MLflow contract (what the UI, `analysis/` and outside tools read; these names never change) is
`contract.py`, re-exported here: one parent run per sweep (tag `fp8rl.role=sweep`), one child run per
cell (`fp8rl.role=cell`, `mlflow.parentRunId`), the child tags (`CELL_TAGS`), the per-step and
validation metrics (`STEP_METRICS`, `VALIDATION_METRICS`, `CONTRACT_METRICS`) and the statuses.
Optional: `tokens_per_s`; the rest of the diagnostics catalogue (fp8rl_core/diagnostics/catalogue.py)
and the `diagnostics/worst_tokens.jsonl` artifact.

Run side (the training loop):

    from fp8rl_core.tracking.sink import make_run_sink
    sink = make_run_sink(cfg, cfg.output_dir)      # JSONL always; + MLflow when cfg.tracking.uri is set
    sink.log_params(flat_config); sink.log(step, {"loss": 0.3, ...}); sink.close("FINISHED")

Driver side (`launchers/`): `runs.py` manages the runs — `ensure_experiment`, `create_parent_run`,
`find_or_create_cell_run`, `cell_states`, `run_statuses`, `start_run`, `end_run` (which ships a cell's
unshipped metrics.jsonl records before it sets the status), `finish_run`; `lifecycle.py` decides
which status each outcome gets (the one table: exceptions, dead jobs, cancels, the parent run);
`store.py` holds the helpers below them (URIs, retries, the one status write) and `Store`, the one
door to MLflow's client; `server.py`: `start_server`.

Modules, lowest first (no cycles): `contract` (names) <- `jsonl` (the local buffer) <- `store` <-
`mlflow_sink` (ships the buffer) <- `runs` <- `lifecycle`, `sink` (what a training run logs through:
`make_run_sink`).

MLflow itself is imported by `store.py` alone, on first use (the client, its entities, its exception
class), so every module here imports cheaply; the submodules below are still loaded on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from fp8rl_core.tracking.contract import *  # noqa: F403  (the contract, re-exported: tracking/contract.py)

_LAZY = {
    "MetricSink": "sink", "JsonlSink": "sink", "MultiSink": "sink", "read_records": "sink", "make_run_sink": "sink",
    "MlflowSink": "mlflow_sink", "replay_buffer": "mlflow_sink",
    "ensure_experiment": "runs", "create_parent_run": "runs", "find_parent_run": "runs",
    "find_or_create_cell_run": "runs", "cell_states": "runs", "start_run": "runs", "end_run": "runs",
    "finish_run": "runs", "run_statuses": "runs", "flatten_params": "store", "context_tags": "store",
    "sqlite_path": "store", "Store": "store", "Lifecycle": "lifecycle",
    "start_server": "server", "MlflowServer": "server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
