"""Metric sinks: the one interface a training loop logs through, and the always-on local JSONL file.

    sink.log(step, {"loss": 0.31, "token_mult_prob_error": 1.02})   # per-step scalars
    sink.log_params({"optim.lr": 2e-4}); sink.set_tags({"host": "n1"}); sink.log_artifact(path)
    sink.flush()            # make everything durable / shipped now (e.g. before a checkpoint)
    sink.close("FINISHED")  # or "FAILED", "KILLED"; None or "RUNNING": leave the run running (requeue)

A training loop gets its sink from its config with `make_run_sink(cfg, output_dir)`.

A step is recorded once per metric key: the first value wins. A requeued run that resumes from a
checkpoint older than its last logged step recomputes some steps; their values are dropped (counted
in `sink.dropped`) instead of duplicating steps (MLflow cannot delete a logged value).

JSONL buffer format, one JSON object per line, append-only (`time_ms`: wall clock at log time):
    {"kind": "metrics", "step": 3, "time_ms": 1700000000000, "values": {"loss": 0.31}}
    {"kind": "params", "time_ms": ..., "values": {"optim.lr": 0.0002}}
    {"kind": "tags", "time_ms": ..., "values": {"host": "n1"}}
    {"kind": "artifact", "time_ms": ..., "path": "/abs/file.png", "artifact_path": "figures"}
    {"kind": "status", "time_ms": ..., "status": "FINISHED"}
A torn last line (a kill mid-write) is cut off when the file is reopened.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from fp8rl_core.tracking import FINISHED, METRICS_FILE, TAG_CELL_ID, TAG_IS, TAG_RECIPE, TAG_SEED
from fp8rl_core.tracking.jsonl import RUN_STATUSES, JsonlSink, check_status, now_ms, read_records, to_metric_values
from fp8rl_core.tracking.mlflow_sink import MlflowSink
from fp8rl_core.tracking.runs import create_run

if TYPE_CHECKING:  # the sinks take a RunConfig; tracking imports the config package lazily (where it reads it)
    from fp8rl_core.config import RunConfig

__all__ = ["RUN_STATUSES", "JsonlSink", "MetricSink", "MultiSink", "check_status", "make_run_sink", "now_ms",
           "read_records", "run_params", "to_metric_values"]

log = logging.getLogger(__name__)

RUN_ID_FILE = "mlflow_run_id"  # under output_dir: the MLflow run a standalone run created for itself


@runtime_checkable
class MetricSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def set_tags(self, tags: Mapping[str, Any]) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self, status: str | None = FINISHED) -> None: ...

class NullSink:
    """A MetricSink that keeps nothing: the sink of ranks other than 0 (rank 0 alone writes the run's
    files and talks to MLflow)."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def set_tags(self, tags: Mapping[str, Any]) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self, status: str | None = FINISHED) -> None: ...



class MultiSink:
    """Fan out to several sinks; `close` closes all of them even when one fails."""

    def __init__(self, *sinks: MetricSink):
        self.sinks = list(sinks)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for s in self.sinks:
            s.log(step, metrics)

    def log_params(self, params: Mapping[str, Any]) -> None:
        for s in self.sinks:
            s.log_params(params)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        for s in self.sinks:
            s.set_tags(tags)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        for s in self.sinks:
            s.log_artifact(path, artifact_path)

    def flush(self) -> None:
        for s in self.sinks:
            s.flush()

    def close(self, status: str | None = FINISHED) -> None:
        errors = []
        for s in self.sinks:
            try:
                s.close(status)
            except Exception as e:  # close the others first, then report
                errors.append(e)
        if errors:
            raise errors[0]


def run_params(cfg: RunConfig) -> dict[str, Any]:
    """A run's params: its resolved `RunConfig` without `tracking` (where it logs, not what it computes;
    MLflow shows the run ids anyway). The one rule for the sweep driver, which logs them when it
    creates a cell's run, and for a run without a sweep: MLflow refuses a param whose value changes,
    so every writer must derive them from the same resolved config."""
    from fp8rl_core.config.schema import to_dict

    data = to_dict(cfg)
    data.pop("tracking", None)
    return data


def _standalone_run_id(cfg: RunConfig, out_dir: Path) -> str:
    """The MLflow run of a run started without a sweep: created once, its id kept in output_dir."""
    path = out_dir / RUN_ID_FILE
    if path.exists():
        return path.read_text().strip()
    from fp8rl_core.config import run_config_hash

    tags = {TAG_RECIPE: cfg.recipe, TAG_IS: cfg.loss.importance_sampling, TAG_SEED: cfg.seed,
            TAG_CELL_ID: run_config_hash(cfg), **cfg.tracking.tags}
    run_id = create_run(cfg.tracking.uri, cfg.tracking.experiment, tags=tags)
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def make_run_sink(cfg: RunConfig, out_dir: str | Path, resume_step: int | None = None) -> MetricSink:
    """The sink of one run from its `RunConfig`: `out_dir/metrics.jsonl` always, MLflow too when
    `cfg.tracking.uri` is set (into `cfg.tracking.run_id`, the cell run the sweep driver created, or
    else into a run created once for this output_dir).

    `resume_step` (the checkpoint step a resumed run restarts after) is informational: a resumed run
    may log steps again, and the sink keeps the first value of each (key, step) in any case.
    """
    out = Path(out_dir)
    if not cfg.tracking.uri:
        sink: MetricSink = JsonlSink(out / METRICS_FILE)
    else:
        run_id = cfg.tracking.run_id or _standalone_run_id(cfg, out)
        sink = MlflowSink(cfg.tracking.uri, run_id, out / METRICS_FILE)
    if resume_step:
        log.info("%s: resuming after step %d; steps already recorded keep their first values", out, resume_step)
    return sink
