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

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Protocol, runtime_checkable

log = logging.getLogger(__name__)

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
RUN_ID_FILE = "mlflow_run_id"  # under output_dir: the MLflow run a standalone run created for itself


@runtime_checkable
class MetricSink(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def log_params(self, params: Mapping[str, Any]) -> None: ...

    def set_tags(self, tags: Mapping[str, Any]) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self, status: str | None = "FINISHED") -> None: ...


def now_ms() -> int:
    return int(time.time() * 1000)


def check_status(status: str | None) -> str | None:
    """A terminal status, or None for "leave the run RUNNING" (also spelled "RUNNING")."""
    if status is None or status == "RUNNING":
        return None
    if status not in RUN_STATUSES:
        raise ValueError(f"status: {status!r} is not allowed; valid: {', '.join(RUN_STATUSES)}, RUNNING or None")
    return status


def to_metric_values(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Validate keys and convert values (Python/numpy/0-d torch scalars) to float."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric key {key!r}: must be a non-empty string")
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__} {value!r}") from None
    return out


def read_records(path: str | Path, start: int = 0) -> Iterator[tuple[int, dict]]:
    """Yield `(end_offset, record)` for each complete line from byte `start` (torn tail ignored)."""
    path = Path(path)
    if not path.exists():
        return
    with open(path, "rb") as f:
        f.seek(start)
        offset = start
        for raw in f:
            if not raw.endswith(b"\n"):
                break  # an incomplete line: a writer is mid-write, or a kill tore it
            offset += len(raw)
            try:
                record = json.loads(raw)
            except ValueError:
                log.warning("%s: skipping an unreadable line ending at byte %d", path, offset)
                continue
            yield offset, record


def _cut_torn_tail(path: Path) -> None:
    """Truncate after the last newline, so the next record starts on a line of its own."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        keep = data.rfind(b"\n") + 1
        f.truncate(keep)
        log.warning("%s: cut a torn last line (%d bytes)", path, len(data) - keep)


class JsonlSink:
    """Append-only JSONL file of everything a run logs; safe to reopen after a requeue.

    Each record is one `write` followed by a flush, so a killed process loses at most the record
    being written (a machine crash may lose what the OS had not written yet; `close` fsyncs).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_torn_tail(self.path)
        self.last_step: dict[str, int] = {}  # metric key -> highest step recorded
        for _, rec in read_records(self.path):
            if rec.get("kind") == "metrics":
                for key in rec.get("values", {}):
                    self.last_step[key] = max(self.last_step.get(key, -1), int(rec["step"]))
        self.dropped = 0  # (key, step) values not recorded because that step was already there
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")

    def _write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"{self.path}: sink is closed")
            self._file.write(line)
            self._file.flush()

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Record `metrics` at `step`; returns the values actually recorded (first write wins)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"step: expected an int >= 0, got {step!r}")
        values = to_metric_values(metrics)
        fresh = {k: v for k, v in values.items() if step > self.last_step.get(k, -1)}
        if len(fresh) < len(values):
            self.dropped += len(values) - len(fresh)
            log.info("%s: step %d already recorded for %s; keeping the first values",
                     self.path, step, sorted(set(values) - set(fresh)))
        if fresh:
            self._write({"kind": "metrics", "step": step, "time_ms": now_ms(),
                         "values": {k: (v if math.isfinite(v) else str(v)) for k, v in fresh.items()}})
            for k in fresh:
                self.last_step[k] = step
        return fresh

    def log_params(self, params: Mapping[str, Any]) -> None:
        if params:
            self._write({"kind": "params", "time_ms": now_ms(), "values": dict(params)})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if tags:
            self._write({"kind": "tags", "time_ms": now_ms(), "values": {k: str(v) for k, v in tags.items()}})

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path).resolve()
        if not path.exists():
            raise FileNotFoundError(f"log_artifact: {path} does not exist")
        self._write({"kind": "artifact", "time_ms": now_ms(), "path": str(path), "artifact_path": artifact_path})

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
                os.fsync(self._file.fileno())

    def mark(self, status: str) -> None:
        """Record a run status change (RUNNING at start, a terminal status at close)."""
        self._write({"kind": "status", "time_ms": now_ms(), "status": status})

    def close(self, status: str | None = "FINISHED") -> None:
        status = check_status(status)
        if self._file.closed:
            return
        if status is not None:
            self.mark(status)
        self.flush()
        with self._lock:
            self._file.close()


def metric_value(raw: Any) -> float:
    """Inverse of the JSONL encoding: non-finite values are stored as the strings 'nan', 'inf'."""
    return float(raw)


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

    def close(self, status: str | None = "FINISHED") -> None:
        errors = []
        for s in self.sinks:
            try:
                s.close(status)
            except Exception as e:  # close the others first, then report
                errors.append(e)
        if errors:
            raise errors[0]


def _standalone_run_id(cfg: Any, out_dir: Path) -> str:
    """The MLflow run of a run started without a sweep: created once, its id kept in output_dir."""
    path = out_dir / RUN_ID_FILE
    if path.exists():
        return path.read_text().strip()
    from fp8rl_core.config import run_config_hash
    from fp8rl_core.tracking.runs import create_run

    tags = {"recipe": cfg.recipe, "importance_sampling": cfg.loss.importance_sampling, "seed": cfg.seed,
            "cell_id": run_config_hash(cfg), **cfg.tracking.tags}
    run_id = create_run(cfg.tracking.uri, cfg.tracking.experiment, tags=tags)
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


def make_run_sink(cfg: Any, out_dir: str | Path, resume_step: int | None = None) -> MetricSink:
    """The sink of one run from its `RunConfig`: `out_dir/metrics.jsonl` always, MLflow too when
    `cfg.tracking.uri` is set (into `cfg.tracking.run_id`, the cell run the sweep driver created, or
    else into a run created once for this output_dir).

    `resume_step` (the checkpoint step a resumed run restarts after) is informational: a resumed run
    may log steps again, and the sink keeps the first value of each (key, step) in any case.
    """
    from fp8rl_core.tracking import METRICS_FILE

    out = Path(out_dir)
    if not cfg.tracking.uri:
        sink: MetricSink = JsonlSink(out / METRICS_FILE)
    else:
        from fp8rl_core.tracking.mlflow_sink import MlflowSink

        run_id = cfg.tracking.run_id or _standalone_run_id(cfg, out)
        sink = MlflowSink(cfg.tracking.uri, run_id, out / METRICS_FILE)
    if resume_step:
        log.info("%s: resuming after step %d; steps already recorded keep their first values", out, resume_step)
    return sink
