"""Executors: where a sweep's jobs run. `make_executor(sweep)` picks one by `launcher.kind`.

- local: submitit LocalExecutor, at most `max_parallel` processes at once (our limit);
- slurm: submitit SlurmExecutor, one job array per batch with `%max_parallel`;
- debug: in-process, one after another.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from launchers.executors.base import (ALIVE, CANCELLED, DONE, FAILED, PENDING, RUNNING, UNKNOWN, Executor,
                                      JobHandle, Task, is_alive)

if TYPE_CHECKING:  # pragma: no cover
    from launchers.sweep_file import Sweep

__all__ = ["ALIVE", "CANCELLED", "DONE", "FAILED", "PENDING", "RUNNING", "UNKNOWN", "Executor", "JobHandle",
           "Task", "is_alive", "make_executor"]


def make_executor(sweep: "Sweep", kind: str | None = None) -> Executor:
    """The executor of `launcher.kind` (or `kind`), writing job files under `<sweep folder>/jobs`."""
    kind = kind or sweep.launcher.kind
    if kind == "local":
        from launchers.executors.local import LocalExecutor

        # launcher.slurm.python/setup are for cluster nodes; local jobs run this interpreter, no shell
        return LocalExecutor(sweep.folder, sweep.launcher.max_parallel)
    if kind == "slurm":
        from launchers.executors.slurm import SlurmExecutor
        from launchers.sbatch_preview import slurm_submission

        return SlurmExecutor(slurm_submission(sweep))
    if kind == "debug":
        from launchers.executors.debug import DebugExecutor

        return DebugExecutor(sweep.folder)
    raise ValueError(f"launcher.kind: {kind!r} is not an executor; valid: local, slurm, debug")
