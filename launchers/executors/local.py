"""Local processes through submitit's LocalExecutor, with the concurrency limit submitit lacks.

Each task runs in its own process under a submitit controller (job id: the controller's pid), which
restarts it after a checkpoint/requeue (USR2). `slots()` keeps at most `max_parallel` alive: the
driver submits more as jobs end. `poll` looks at the processes it started (and, for jobs started by
another driver, at /proc, checking that the pid is still a submitit controller and not a reused pid).

A cell of `launcher.ranks_per_cell` = N > 1 ranks is one controller with N tasks (submitit's
`tasks_per_node`): the controller starts N processes, each with its SUBMITIT_LOCAL_GLOBALID, and
MASTER_ADDR=127.0.0.1 and a free MASTER_PORT chosen here; `launchers.run.jobs.CellJob` turns them into
RANK/WORLD_SIZE/LOCAL_RANK, so every process joins the cell's gloo group. Cancel (SIGINT to the
controller) stops all N. Such a cell takes N of max_parallel's slots.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8rl_core.io.environ import environ
from fp8rl_core.io.ports import free_port
from launchers.executors.base import CANCELLED, DONE, FAILED, RUNNING, UNKNOWN, JobHandle, Task
from launchers.process import cmdline, interrupt, restore_sigint

__all__ = ["LocalExecutor", "controller_alive", "restore_sigint"]  # restore_sigint: launchers.process

CONTROLLER_MODULE = "submitit.local._local"
NO_TIME_LIMIT_MIN = 60 * 24 * 365  # submitit's local default is 2 minutes; a run takes what it takes


def controller_alive(pid: int, folder: Path | None = None) -> bool:
    """True when `pid` is a live submitit local controller (of `folder`'s jobs, when given)."""
    argv = cmdline(pid)
    if not argv or CONTROLLER_MODULE not in argv:
        return False
    return folder is None or any(str(folder) in a for a in argv)


class LocalExecutor:
    kind = "local"

    def __init__(self, folder: Path, max_parallel: int, signal_delay_s: int = 30, ranks_per_cell: int = 1):
        import submitit

        restore_sigint()  # before any controller starts: they must inherit a cancellable SIGINT
        self.folder = Path(folder)
        self.max_parallel = max_parallel
        self.ranks_per_cell = ranks_per_cell  # processes per cell: each takes one slot of max_parallel
        self._ex = submitit.LocalExecutor(folder=self.folder / "jobs")  # files named by job id
        self._ex.update_parameters(timeout_min=NO_TIME_LIMIT_MIN, signal_delay_s=signal_delay_s)
        self._jobs: dict[str, Any] = {}  # job_id -> submitit LocalJob (its Popen), for jobs we started
        self._cancelled: set[str] = set()

    def slots(self, running: int) -> int:
        """Cells that may start now with `running` cells alive: a cell of N ranks takes N slots."""
        n = self.ranks_per_cell
        return max(0, (self.max_parallel - running * n) // n)

    def submit(self, tasks: Sequence[Task], dependency: str | None = None) -> list[JobHandle]:
        if dependency is not None:
            raise ValueError("the local executor runs stages in order itself; dependencies are for SLURM")
        handles = []
        for task in tasks:
            self._ex.update_parameters(tasks_per_node=task.ranks)
            if task.ranks > 1:  # every rank of the controller's tasks inherits these
                with environ({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}):
                    job = self._ex.submit(task.fn, *task.args)
            else:
                job = self._ex.submit(task.fn, *task.args)
            self._jobs[job.job_id] = job
            handles.append(JobHandle(task.name, job.job_id, self.kind, str(job.paths.stdout), str(job.paths.stderr)))
        return handles

    def poll(self, handles: Sequence[JobHandle]) -> dict[str, str]:
        out = {}
        for h in handles:
            job = self._jobs.get(h.job_id)
            if job is not None:
                code = job._process.poll() if job._process is not None else 0
                if code is None:
                    out[h.job_id] = RUNNING
                else:
                    out[h.job_id] = CANCELLED if h.job_id in self._cancelled else DONE if code == 0 else FAILED
            else:  # started by another driver: alive or not is all we can tell
                out[h.job_id] = RUNNING if controller_alive(int(h.job_id), self.folder) else UNKNOWN
        return out

    def cancel(self, handles: Sequence[JobHandle]) -> None:
        """SIGINT each controller (as submitit's LocalJob.cancel): it stops its task, then exits."""
        for h in handles:
            pid = int(h.job_id)
            if controller_alive(pid, self.folder):
                interrupt(pid)
                self._cancelled.add(h.job_id)

    def wait(self, handles: Sequence[JobHandle], timeout_s: float) -> bool:
        """Wait until none of `handles` is alive (True) or `timeout_s` passes (False)."""
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(s != RUNNING for s in self.poll(handles).values()):
                return True
            time.sleep(0.2)
        return False
