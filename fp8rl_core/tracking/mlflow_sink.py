"""MLflow sink: every record goes to the run's local append-only JSONL first, then is shipped to MLflow
in batches (`MlflowClient.log_batch`, <= 1000 metrics, <= 100 params/tags per call) by a background
thread, every `flush_interval_s` or as soon as 1000 metrics are pending.

Nothing is lost and nothing is duplicated:
- The shipper reads the JSONL from a byte offset; the offset of the last record MLflow acknowledged is
  kept in `<buffer>.shipped.json` (with the run id). While the tracking server is unreachable
  (connection refused, 5xx, SQLite "database is locked") records stay in the file and the shipper
  retries with exponential backoff and jitter (`initial_backoff_s` doubling up to `max_backoff_s`).
  For an http(s) URI a 2 s probe of `/health` comes first, so a dead server costs no long retries.
- Reopening the sink on the same buffer (a requeued job, or `replay_buffer`) ships what was not
  acknowledged. A record acknowledged but not yet recorded in the offset file (a kill between the
  two) is shipped again with its original timestamp: MLflow's SQL store drops an exact duplicate
  (same key, step, timestamp, value), so the replay adds nothing.
- Steps are first-write-wins per metric key (see `sink.JsonlSink`); when the buffer is empty at open
  (fresh run, or a requeue on a machine without the old output dir) the run's latest step per key is
  read from MLflow, so a resumed run never logs a step MLflow already has.
- Records a store rejects for good (bad values, a deleted run) are skipped one by one with an error
  log and counted in `rejected`, so one bad record cannot block the rest.

Lifecycle: opening marks the run RUNNING and tags `host`/`slurm_job_id`; `close(status)` ships
everything (waiting up to `close_timeout_s`) and marks the run FINISHED/FAILED/KILLED; `close(None)`
or `close("RUNNING")` (preemption: the job will be requeued) ships everything and leaves it RUNNING. If MLflow is
still unreachable at close, the records stay in the buffer for the next open or `replay_buffer`.
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8rl_core.tracking.contract import FINISHED, RUNNING
from fp8rl_core.tracking.jsonl import JsonlSink, check_status, read_records
from fp8rl_core.tracking.store import (
    MAX_TAG_VALUE_LEN,
    Store,
    context_tags,
    entity_types,
    flatten_params,
    mlflow_error,
    set_status,
)

if TYPE_CHECKING:
    from mlflow.entities import Metric, Param, RunTag

log = logging.getLogger(__name__)

MAX_METRICS, MAX_PARAMS_TAGS, MAX_ENTITIES = 1000, 100, 1000  # MLflow's log_batch limits
# Errors that retrying cannot fix: the record is skipped (and logged), not retried forever.
PERMANENT_ERRORS = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE", "MALFORMED_REQUEST",
                    "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_ALREADY_EXISTS"}


@dataclass
class _Chunk:
    """Consecutive records shipped together; `end` is the buffer offset after the last one."""
    end: int = 0
    metrics: list[Metric] = field(default_factory=list)
    params: list[Param] = field(default_factory=list)
    tags: list[RunTag] = field(default_factory=list)
    other: dict | None = None  # one artifact or status record, shipped on its own
    records: list[dict] = field(default_factory=list)

    def size(self) -> int:
        return len(self.metrics) + len(self.params) + len(self.tags)

    def fits(self, n_metrics: int, n_params: int, n_tags: int) -> bool:
        return (len(self.metrics) + n_metrics <= MAX_METRICS and len(self.params) + n_params <= MAX_PARAMS_TAGS
                and len(self.tags) + n_tags <= MAX_PARAMS_TAGS
                and self.size() + n_metrics + n_params + n_tags <= MAX_ENTITIES)


def _entities(rec: dict) -> tuple[list[Metric], list[Param], list[RunTag]]:
    kind, values = rec.get("kind"), rec.get("values") or {}
    Metric, Param, RunTag = entity_types()  # MLflow's classes, imported on first use
    if kind == "metrics":
        return [Metric(k, float(v), int(rec["time_ms"]), int(rec["step"])) for k, v in values.items()], [], []
    if kind == "params":
        return [], [Param(k, v) for k, v in flatten_params(values).items()], []
    if kind == "tags":
        return [], [], [RunTag(k, str(v)[:MAX_TAG_VALUE_LEN]) for k, v in values.items()]
    return [], [], []


def chunks(records: Iterator[tuple[int, dict]]) -> Iterator[_Chunk]:
    """Group buffer records into `log_batch`-sized chunks, keeping their order.

    A record larger than one batch becomes a chunk of its own, which `_send` splits.
    """
    cur = _Chunk()
    for end, rec in records:
        if rec.get("kind") in ("artifact", "status"):
            if cur.records:
                yield cur
            yield _Chunk(end=end, other=rec, records=[rec])
            cur = _Chunk(end=end)
            continue
        m, p, t = _entities(rec)
        if cur.records and not cur.fits(len(m), len(p), len(t)):
            yield cur
            cur = _Chunk()
        cur.metrics += m
        cur.params += p
        cur.tags += t
        cur.records.append(rec)
        cur.end = end
    if cur.records:
        yield cur


def is_permanent(error: BaseException) -> bool:
    return isinstance(error, mlflow_error()) and error.error_code in PERMANENT_ERRORS


class MlflowSink:
    """`MetricSink` that buffers to `buffer_path` (JSONL) and ships to MLflow run `run_id` at `uri`."""

    def __init__(self, uri: str, run_id: str, buffer_path: str | Path, *, flush_interval_s: float = 2.0,
                 background: bool = True, initial_backoff_s: float = 0.5, max_backoff_s: float = 60.0,
                 close_timeout_s: float = 120.0, start: bool = True):
        self.uri, self.run_id = uri, run_id
        self.flush_interval_s, self.close_timeout_s = flush_interval_s, close_timeout_s
        self.initial_backoff_s, self.max_backoff_s = initial_backoff_s, max_backoff_s
        self.buffer = JsonlSink(buffer_path)
        self.state_path = Path(f"{self.buffer.path}.shipped.json")
        self.offset = self._load_offset()
        self.shipped = self.rejected = self.failures = self.batches = 0
        self.last_error: str | None = None
        self._client: Store | None = None
        self._backoff, self._next_try, self._pending = 0.0, 0.0, 0
        self._ship_lock = threading.Lock()
        self._wake, self._stop = threading.Event(), threading.Event()
        if not self.buffer.last_step:
            self._merge_remote_last_steps()
        if start:  # a requeued run says RUNNING again; also where/which job runs it now
            self.buffer.mark(RUNNING)
            self.buffer.set_tags(context_tags(git=False))
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name=f"mlflow-sink-{run_id[:8]}", daemon=True)
            self._thread.start()

    # --- the MetricSink interface ---------------------------------------------------------------
    @property
    def dropped(self) -> int:
        return self.buffer.dropped

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        fresh = self.buffer.log(step, metrics)
        self._pending += len(fresh)
        if self._pending >= MAX_METRICS:
            self._wake.set()
        return fresh

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.buffer.log_params(params)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.buffer.set_tags(tags)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.buffer.log_artifact(path, artifact_path)

    def flush(self, timeout_s: float = 0.0) -> bool:
        """Ship everything now, retrying with backoff for up to `timeout_s`; True if all shipped."""
        self.buffer.flush()
        deadline = time.monotonic() + timeout_s
        self._next_try = 0.0  # an explicit flush tries at once
        while True:
            if self.ship():
                return True
            wait = self._next_try - time.monotonic()
            if time.monotonic() + max(wait, 0) > deadline:
                return False
            time.sleep(max(wait, 0.01))

    def close(self, status: str | None = FINISHED) -> bool:
        """Ship everything and set the run's status; True if MLflow has every record."""
        status = check_status(status)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self.buffer.close(status)
        done = self.flush(self.close_timeout_s)
        if not done:
            log.warning("MLflow run %s: %s unreachable (%s); the unsent records stay in %s and are shipped "
                        "when the sink is reopened or by fp8rl_core.tracking.replay_buffer(uri, run_id, path)",
                        self.run_id, self.uri, self.last_error, self.buffer.path)
        return done

    # --- shipping ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if not self._stop.is_set():
                self.ship()

    @property
    def client(self) -> Store:
        if self._client is None:
            self._client = Store(self.uri)
        return self._client

    def ship(self) -> bool:
        """One shipping pass over the unacknowledged records; True when none is left."""
        with self._ship_lock:
            if time.monotonic() < self._next_try:
                return False
            self._pending = 0
            try:
                self._probe()
                for chunk in chunks(read_records(self.buffer.path, self.offset)):
                    self._send_chunk(chunk)
                    self.offset = chunk.end
                    self._save_offset()
            except Exception as e:  # transient: keep the records, back off, try again later
                self._failed(e)
                return False
            self._backoff = 0.0
            return True

    def _failed(self, error: BaseException) -> None:
        self.failures += 1
        self.last_error = f"{type(error).__name__}: {str(error)[:300]}"
        self._backoff = min(self.max_backoff_s, max(self.initial_backoff_s, 2 * self._backoff))
        self._next_try = time.monotonic() + self._backoff * (1 + 0.25 * random.random())  # jitter: writers desync
        log.warning("MLflow run %s: shipping failed (%s); retry in %.1f s", self.run_id, self.last_error, self._backoff)

    def _probe(self) -> None:
        if self.uri.startswith(("http://", "https://")):
            with urllib.request.urlopen(self.uri.rstrip("/") + "/health", timeout=2.0) as r:
                if r.status != 200:
                    raise ConnectionError(f"{self.uri}/health answered {r.status}")

    def _send_chunk(self, chunk: _Chunk) -> None:
        try:
            self._send(chunk)
        except Exception as e:
            if not is_permanent(e):
                raise
            if len(chunk.records) == 1:
                self.rejected += 1
                log.error("MLflow run %s rejected a record (skipped, kept in %s): %s: %s",
                          self.run_id, self.buffer.path, str(e)[:300], json.dumps(chunk.records[0])[:300])
                return
            for rec in chunk.records:  # isolate the bad record; the others go through
                self._send_chunk(next(chunks(iter([(chunk.end, rec)]))))

    def _send(self, chunk: _Chunk) -> None:
        if chunk.other is not None:
            self._send_other(chunk.other)
            return
        m, p, t = chunk.metrics, chunk.params, chunk.tags
        while m or p or t:  # a record bigger than one batch: several calls
            bp = p[:MAX_PARAMS_TAGS]
            bt = t[:MAX_PARAMS_TAGS]
            bm = m[: min(MAX_METRICS, MAX_ENTITIES - len(bp) - len(bt))]  # all three count towards 1000
            self.client.log_batch(self.run_id, metrics=bm, params=bp, tags=bt, synchronous=True)
            self.batches += 1
            self.shipped += len(bm)
            m, p, t = m[len(bm):], p[len(bp):], t[len(bt):]

    def _send_other(self, rec: dict) -> None:
        if rec["kind"] == "artifact":
            if Path(rec["path"]).exists():
                self.client.log_artifact(self.run_id, rec["path"], rec.get("artifact_path"))
            else:
                log.error("MLflow run %s: artifact %s vanished before it was shipped", self.run_id, rec["path"])
        else:
            set_status(self.client, self.run_id, rec["status"], end_time=int(rec["time_ms"]))

    # --- resume state -----------------------------------------------------------------------------
    def _load_offset(self) -> int:
        if not self.state_path.exists():
            return 0
        state = json.loads(self.state_path.read_text())
        if state.get("run_id") != self.run_id:
            raise ValueError(f"{self.buffer.path} belongs to MLflow run {state.get('run_id')}, not {self.run_id}; "
                             "a run never ships another run's buffer (use a fresh output_dir)")
        size = self.buffer.path.stat().st_size if self.buffer.path.exists() else 0
        return min(int(state.get("offset", 0)), size)

    def _save_offset(self) -> None:
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        tmp.write_text(json.dumps({"run_id": self.run_id, "uri": self.uri, "offset": self.offset}))
        os.replace(tmp, self.state_path)  # atomic: a kill leaves the old or the new offset

    def _merge_remote_last_steps(self) -> None:
        """An empty buffer on a run MLflow already has steps for: start after MLflow's last steps."""
        try:
            self._probe()
            latest = self.client.get_run(self.run_id).data._metric_objs  # key's value at its max step
        except Exception as e:
            log.warning("MLflow run %s: could not read its last logged steps (%s); steps are deduplicated "
                        "against the local buffer only", self.run_id, e)
            return
        for m in latest:
            self.buffer.last_step[m.key] = max(self.buffer.last_step.get(m.key, -1), int(m.step))


def replay_buffer(uri: str, run_id: str, buffer_path: str | Path, timeout_s: float = 120.0) -> bool:
    """Ship whatever `buffer_path` holds that MLflow run `run_id` has not acknowledged yet.

    Leaves the run's status to the records (a buffer that ends with FINISHED marks the run FINISHED).
    """
    sink = MlflowSink(uri, run_id, buffer_path, background=False, start=False, close_timeout_s=timeout_s)
    return sink.close(None)
