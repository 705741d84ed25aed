"""In-process, one task after another: `launcher.kind: debug` (breakpoints and tracebacks work).

`submit` runs each task before returning (so it returns when the batch is done); a task's exception
is caught, its traceback printed and written to `<folder>/jobs/debug-<pid>-N.err` (what `sweep status`
shows), and its handle polls FAILED. Nothing can be cancelled: it has already run.
"""
from __future__ import annotations

import itertools
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from launchers.executors.base import DONE, FAILED, UNKNOWN, JobHandle, Task


class DebugExecutor:
    kind = "debug"

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._states: dict[str, str] = {}
        self._ids = itertools.count()

    def slots(self, running: int) -> int:
        return 1  # submit blocks: one task per tick keeps the driver's progress output alive

    def submit(self, tasks: Sequence[Task], dependency: str | None = None) -> list[JobHandle]:
        handles = []
        for task in tasks:
            job_id = f"debug-{os.getpid()}-{next(self._ids)}"  # unique across drivers
            err = self.folder / "jobs" / f"{job_id}.err"
            try:
                task.fn(*task.args)
                self._states[job_id] = DONE
            except Exception:  # the cell failed: record it, go on with the sweep
                text = traceback.format_exc()
                print(text, file=sys.stderr)
                err.parent.mkdir(parents=True, exist_ok=True)
                err.write_text(text)
                self._states[job_id] = FAILED
            handles.append(JobHandle(task.name, job_id, self.kind, None, str(err)))
        return handles

    def poll(self, handles: Sequence[JobHandle]) -> dict[str, str]:
        return {h.job_id: self._states.get(h.job_id, UNKNOWN) for h in handles}

    def cancel(self, handles: Sequence[JobHandle]) -> None:
        return None
