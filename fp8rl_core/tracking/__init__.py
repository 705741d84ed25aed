"""Tracking: where a run's metrics go (local JSONL always, MLflow when configured) and the MLflow
run management the sweep driver uses.

The MLflow contract (what the UI, `analysis/` and outside tools read; these names never change):
- one parent run per sweep (tag `fp8rl.role=sweep`), one child run per cell (`fp8rl.role=cell`,
  `mlflow.parentRunId`), child tags `sweep`, `cell_id`, `recipe`, `importance_sampling`, `seed`;
- per-step metrics `token_mult_prob_error`, `reward_mean`, `val_accuracy` (validation steps only,
  a fraction in [0, 1]), `is_weight_mean`, `loss`, `step_time_s`. Optional: `tokens_per_s`.

Run side (the training loop):

    from fp8rl_core.tracking.sink import make_run_sink
    sink = make_run_sink(cfg, cfg.output_dir)      # JSONL always; + MLflow when cfg.tracking.uri is set
    sink.log_params(flat_config); sink.log(step, {"loss": 0.3, ...}); sink.close("FINISHED")
    # or open_sink(output_dir, uri, run_id) without a RunConfig

Driver side (`launchers/`), see `runs.py`: `ensure_experiment`, `create_parent_run`,
`find_or_create_cell_run`, `cell_states`, `finish_run`; `server.py`: `start_server`.

Submodules that import MLflow are loaded lazily, so that `import fp8rl_core.tracking` stays cheap.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# --- the contract -------------------------------------------------------------------------------
TAG_SWEEP = "sweep"
TAG_CELL_ID = "cell_id"
TAG_RECIPE = "recipe"
TAG_IS = "importance_sampling"
TAG_SEED = "seed"
TAG_ROLE = "fp8rl.role"  # "sweep" on the parent run, "cell" on each child
TAG_PARENT = "mlflow.parentRunId"  # MLflow's own: the UI nests child runs under their parent
CELL_TAGS = (TAG_SWEEP, TAG_CELL_ID, TAG_RECIPE, TAG_IS, TAG_SEED)

M_MISMATCH = "token_mult_prob_error"
M_REWARD = "reward_mean"
M_VAL_ACC = "val_accuracy"
M_IS_WEIGHT = "is_weight_mean"
M_LOSS = "loss"
M_STEP_TIME = "step_time_s"
M_TOKENS_PER_S = "tokens_per_s"  # optional; the summary table shows it when logged
CONTRACT_METRICS = (M_MISMATCH, M_REWARD, M_VAL_ACC, M_IS_WEIGHT, M_LOSS, M_STEP_TIME)

METRICS_FILE = "metrics.jsonl"  # the run's append-only buffer, under its output_dir

_LAZY = {
    "MetricSink": "sink", "JsonlSink": "sink", "MultiSink": "sink", "read_records": "sink", "make_run_sink": "sink",
    "MlflowSink": "mlflow_sink", "replay_buffer": "mlflow_sink",
    "ensure_experiment": "runs", "create_parent_run": "runs", "find_parent_run": "runs",
    "find_or_create_cell_run": "runs", "cell_states": "runs", "finish_run": "runs",
    "flatten_params": "runs", "context_tags": "runs",
    "start_server": "server", "MlflowServer": "server",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_sink(output_dir: str | Path, uri: str | None = None, run_id: str | None = None, **kwargs: Any):
    """The sink a run should use: `output_dir/metrics.jsonl` always; MLflow too when `uri` is set.

    With `uri` and `run_id` (the cell run the driver created) this is an `MlflowSink` whose local
    buffer is that same JSONL file; `kwargs` go to `MlflowSink`. With `uri` but no `run_id` it is an
    error (a run never creates its own MLflow run: the driver owns run creation).
    """
    path = Path(output_dir) / METRICS_FILE
    if uri is None:
        from fp8rl_core.tracking.sink import JsonlSink

        return JsonlSink(path)
    if not run_id:
        raise ValueError("tracking.run_id: required when tracking.uri is set (the sweep driver creates the "
                         "cell's MLflow run; a run without a sweep uses make_run_sink, which creates one)")
    from fp8rl_core.tracking.mlflow_sink import MlflowSink

    return MlflowSink(uri, run_id, path, **kwargs)
