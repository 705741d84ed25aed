"""What every executor offers the driver: submit a batch of jobs, poll them all at once, cancel them.

A job is a callable plus its arguments (`Task`): a cell (`launchers.run.jobs.CellJob`), the warm-start
stage or the report stage. `submit` returns one `JobHandle` per task, in order; `poll` answers the
state of many handles with ONE scheduler query (one `sacct` on SLURM, one look at the processes
locally); `cancel` ends them with one call. Handles are plain data, kept in the sweep state, so that
`sweep status`/`sweep cancel` in another shell can poll and cancel the jobs of a running sweep.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Job states as the driver sees them. ALIVE: the job may still run (or run again, after a requeue).
PENDING, RUNNING, DONE, FAILED, CANCELLED, UNKNOWN = "pending", "running", "done", "failed", "cancelled", "unknown"
ALIVE = frozenset({PENDING, RUNNING})
# A job the scheduler does not know yet (sacct lags sbatch by seconds) is taken as pending this long.
GRACE_S = 120.0


@dataclass(frozen=True)
class Task:
    """One job to run: `fn(*args)` in a process of its own (in-process for the debug executor)."""
    name: str  # a cell id, or a stage name
    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    ranks: int = 1  # processes that run fn (torch.distributed ranks): a cell's launcher world size; stages 1


@dataclass(frozen=True)
class JobHandle:
    name: str  # the task's name (cell id or stage)
    job_id: str  # SLURM: 123 or 123_4 (array task); local: the controller's pid; debug: debug-N
    kind: str  # local | slurm | debug
    stdout: str | None = None
    stderr: str | None = None
    submitted: float = field(default_factory=time.time)


class Executor(Protocol):
    kind: str

    def slots(self, running: int) -> int:
        """How many more jobs may be submitted now, with `running` of ours alive."""
        ...

    def submit(self, tasks: Sequence[Task], dependency: str | None = None) -> list[JobHandle]:
        """Start `tasks` as one batch (one SLURM array); `dependency`: sbatch's, e.g. afterok:123."""
        ...

    def poll(self, handles: Sequence[JobHandle]) -> dict[str, str]:
        """job_id -> PENDING | RUNNING | DONE | FAILED | CANCELLED | UNKNOWN, in one query."""
        ...

    def cancel(self, handles: Sequence[JobHandle]) -> None:
        ...


def is_alive(state: str | None) -> bool:
    return state in ALIVE
