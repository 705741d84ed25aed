"""A sweep's state on disk: which jobs ran which cell, and how each attempt ended.

    <sweep folder>/sweep_state.json     # this file, rewritten atomically (temp file, fsync, rename)
    <sweep folder>/.driver.lock         # held (flock) by the one `sweep run` driving the sweep

MLflow holds what a cell computed (its run status and metrics); this file holds what only the driver
knows: the job ids (so that `sweep status` and `sweep cancel` work from another shell), each
attempt's outcome (so retries are counted across `sweep run` invocations) and the stage jobs (warm
start, report). The driver's pid is in the lock file, which `sweep cancel` reads while it is held.
Outcomes: None (not known yet), "finished", "failed" (counts against
launcher.retries), "cancelled" (by `sweep cancel` or Ctrl-C), "forgiven" (a failure that
`sweep run --retry-failed` no longer counts) and "lost" (a local job that died with its driver: the
driver's failure, not the cell's, so it does not count either).
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "sweep_state.json"
LOCK_FILE = ".driver.lock"
FORMAT = 1


@dataclass
class Attempt:
    job_id: str
    kind: str  # local | slurm | debug
    submitted: float  # unix time
    stderr: str | None = None  # the job's stderr log (its error tail is shown by `sweep status`)
    outcome: str | None = None  # None | finished | failed | cancelled | forgiven | lost
    error: str | None = None  # last lines of the log when it failed
    driver: str | None = None  # the driver session that submitted it (launchers.run.cell_facts.driver_session)


@dataclass
class CellRecord:
    run_id: str | None = None
    attempts: list[Attempt] = field(default_factory=list)
    params: dict[str, Any] | None = None  # the cell's varied values (a search trial's cell is rebuilt from them)

    def failures(self) -> int:
        return sum(a.outcome == "failed" for a in self.attempts)

    def last(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    def open_attempt(self) -> Attempt | None:
        """The last attempt when its outcome is not known yet (its job may still be alive)."""
        last = self.last()
        return last if last is not None and last.outcome is None else None


@dataclass
class StageJob:
    name: str  # warmstart | report
    job_id: str
    kind: str
    stderr: str | None = None


@dataclass
class SweepState:
    experiment: str
    parent_run_id: str | None = None
    kind: str = "local"
    cells: dict[str, CellRecord] = field(default_factory=dict)
    stages: list[StageJob] = field(default_factory=list)
    updated: float = 0.0
    format: int = FORMAT

    def record(self, cell_id: str) -> CellRecord:
        return self.cells.setdefault(cell_id, CellRecord())

    def open_attempts(self) -> Iterator[tuple[str, Attempt]]:
        for cell_id, rec in self.cells.items():
            att = rec.open_attempt()
            if att is not None:
                yield cell_id, att


def state_path(folder: Path) -> Path:
    return Path(folder) / STATE_FILE


def _from_dict(data: dict[str, Any]) -> SweepState:
    cells = {cid: CellRecord(rec.get("run_id"), [Attempt(**a) for a in rec.get("attempts", [])], rec.get("params"))
             for cid, rec in data.get("cells", {}).items()}
    stages = [StageJob(**s) for s in data.get("stages", [])]
    rest = {k: v for k, v in data.items() if k not in ("cells", "stages")}
    return SweepState(**rest, cells=cells, stages=stages)


def load_state(folder: Path) -> SweepState | None:
    """The sweep's state, or None when the sweep never ran here (nothing is created)."""
    path = state_path(folder)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        return _from_dict(data)
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path}: unreadable sweep state ({e}); move it aside to start the sweep's "
                         f"bookkeeping afresh (MLflow still knows which cells finished)") from None


def save_state(folder: Path, state: SweepState) -> None:
    """Write atomically: a reader (or a kill) sees the old file or the new one, never half of one."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state.updated = time.time()
    text = json.dumps(asdict(state), indent=1, sort_keys=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}.", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, state_path(folder))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class DriverBusy(RuntimeError):
    """Another `sweep run` drives this sweep right now."""


class DriverLock:
    """An exclusive, non-blocking flock on `<folder>/.driver.lock` for the life of a driver.

    The kernel drops it when the process dies, so a crashed driver never leaves a stale lock."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> DriverLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            raise DriverBusy(f"another `sweep run` drives this sweep ({self.path}, held by {holder or '?'}); "
                             f"watch it with `sweep status FILE --watch` or stop it with `sweep cancel FILE`") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def is_locked(folder: Path) -> bool:
    """True when a driver holds the sweep's lock now (a live `sweep run`)."""
    path = Path(folder) / LOCK_FILE
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
