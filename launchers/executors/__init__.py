"""Executors: where a sweep's jobs run. `make_executor(sweep)` picks one by `launcher.kind`.

- local: submitit LocalExecutor, at most `max_parallel` processes at once (our limit);
- slurm: submitit SlurmExecutor, one job array per batch with `%max_parallel` (`executors/slurm/`);
- debug: in-process, one after another.

`Executors(sweep)` keeps one executor per kind (a sweep's record may hold jobs of several kinds);
`poll_by_kind(handles, executors)` is THE way to ask for many jobs' states: one scheduler call per kind.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from launchers.executors.base import (
    ALIVE,
    CANCELLED,
    DONE,
    FAILED,
    PENDING,
    RUNNING,
    UNKNOWN,
    Executor,
    JobHandle,
    Task,
    is_alive,
)

if TYPE_CHECKING:  # pragma: no cover
    from launchers.sweepfile.loading import Sweep

__all__ = ["ALIVE", "CANCELLED", "DONE", "FAILED", "PENDING", "RUNNING", "UNKNOWN", "Executor", "Executors",
           "JobHandle", "Task", "by_kind", "is_alive", "make_executor", "poll_by_kind"]


def make_executor(sweep: Sweep, kind: str | None = None) -> Executor:
    """The executor of `launcher.kind` (or `kind`), writing job files under `<sweep folder>/jobs`."""
    kind = kind or sweep.launcher.kind
    if kind == "local":
        from launchers.executors.local import LocalExecutor

        # launcher.slurm.python/setup are for cluster nodes; local jobs run this interpreter, no shell
        return LocalExecutor(sweep.folder, sweep.launcher.max_parallel, ranks_per_cell=sweep.launcher.ranks_per_cell)
    if kind == "slurm":
        from launchers.executors.slurm import SlurmExecutor
        from launchers.executors.slurm.sbatch import slurm_submission

        return SlurmExecutor(slurm_submission(sweep))
    if kind == "debug":
        from launchers.executors.debug import DebugExecutor

        return DebugExecutor(sweep.folder)
    raise ValueError(f"launcher.kind: {kind!r} is not an executor; valid: local, slurm, debug")


class Executors:
    """One executor per kind for a sweep, made on first use; `executors(kind)` returns it."""

    def __init__(self, sweep: Sweep, given: Executor | None = None):
        self.sweep = sweep
        self._by_kind: dict[str, Executor] = {given.kind: given} if given is not None else {}

    def __call__(self, kind: str) -> Executor:
        if kind not in self._by_kind:
            self._by_kind[kind] = make_executor(self.sweep, kind)
        return self._by_kind[kind]


def by_kind(handles: Iterable[JobHandle]) -> dict[str, list[JobHandle]]:
    out: dict[str, list[JobHandle]] = {}
    for h in handles:
        out.setdefault(h.kind, []).append(h)
    return out


def poll_by_kind(handles: Iterable[JobHandle], executors: Executors) -> dict[str, str]:
    """job_id -> job state for every handle, with ONE poll per executor kind (one `sacct` on SLURM)."""
    states: dict[str, str] = {}
    for kind, hs in by_kind(handles).items():
        states.update(executors(kind).poll(hs))
    return states
