"""The run's always-on local buffer: an append-only JSONL file (format in `fp8rl_core.tracking.sink`).

`JsonlSink` writes it (first write wins per metric key and step), `read_records` reads it back from a
byte offset (what `mlflow_sink` ships). No MLflow here.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from fp8rl_core.tracking.contract import END_STATUSES, FINISHED, RUNNING

log = logging.getLogger(__name__)

RUN_STATUSES = END_STATUSES  # what a run may end as (tracking.contract)


def now_ms() -> int:
    return int(time.time() * 1000)


def check_status(status: str | None) -> str | None:
    """A terminal status, or None for "leave the run RUNNING" (also spelled "RUNNING")."""
    if status is None or status == RUNNING:
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

    def close(self, status: str | None = FINISHED) -> None:
        status = check_status(status)
        if self._file.closed:
            return
        if status is not None:
            self.mark(status)
        self.flush()
        with self._lock:
            self._file.close()
