"""Test doubles for the sweep engine: a tiny cell function and a scripted scheduler.

`fake_run(cfg)` stands in for fp8rl_core.loop.run.run: it logs `train.steps` steps through the real run
sink (so MLflow sees RUNNING -> FINISHED/FAILED exactly as from a real run), with
`val_accuracy = 1 - (log10(lr) + 3.5)^2 / 10` (a known optimum at lr = 10^-3.5 for the search tests)
and fails with "impossible lr" when optim.lr >= 0.5. `FakeScheduler` implements the executor
protocol: jobs run in-process when the scheduler has been polled `delay` times after their submit,
and it counts submits (each would be one sbatch), polls and cancels.
"""
from __future__ import annotations

import atexit
import itertools
import math
import shutil
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from launchers.executors.base import CANCELLED, DONE, FAILED, PENDING, RUNNING, UNKNOWN, JobHandle, Task
from launchers.run.jobs import CellJob


def fake_accuracy(lr: float) -> float:
    return 1.0 - (math.log10(lr) + 3.5) ** 2 / 10.0


def fake_run(cfg: Any) -> dict[str, float]:
    from fp8rl_core.tracking.sink import make_run_sink

    sink = make_run_sink(cfg, cfg.output_dir)
    status = "FAILED"
    try:
        if cfg.optim.lr >= 0.5:
            raise RuntimeError(f"impossible lr {cfg.optim.lr}")
        for step in range(1, cfg.train.steps + 1):
            sink.log(step, {"loss": 1.0 / step, "val_accuracy": fake_accuracy(cfg.optim.lr)})
        status = "FINISHED"
        return {"val_accuracy": fake_accuracy(cfg.optim.lr)}
    finally:
        sink.close(status)


_TEMPLATE: list[Path] = []


def mlflow_db(dst: Path) -> Path:
    """Copy an empty, migrated MLflow SQLite store to `dst` (creating one runs MLflow's schema
    migrations, ~8 s on our machine; the copy takes ~0.1 s). Returns dst."""
    if not _TEMPLATE:
        folder = Path(tempfile.mkdtemp(prefix="fp8rl-mlflow-template-"))
        atexit.register(shutil.rmtree, folder, True)
        from mlflow import MlflowClient

        MlflowClient(f"sqlite:///{folder / 'mlflow.db'}").search_experiments()
        _TEMPLATE.append(folder / "mlflow.db")
    shutil.copy(_TEMPLATE[0], dst)
    return dst


def tiny_core_base(steps: int, val_every: int = 1, cache_dir: str | None = None) -> str:
    """A sweep's `base:` section that runs the real core in seconds (tiny preset, 5 warm-start steps,
    2 prompts x 2 samples, a checkpoint every step); YAML text ending in a newline."""
    cache = f", cache_dir: {cache_dir}" if cache_dir else ""
    return ("base:\n  model: {preset: tiny}\n  threads: 1\n  task: {val_size: 8}\n"
            f"  warmstart: {{steps: 5, batch_size: 8{cache}}}\n"
            "  rollout: {prompts_per_step: 2, samples_per_prompt: 2, max_new_tokens: 6}\n"
            f"  train: {{steps: {steps}, val_every: {val_every}, checkpoint_every: 1}}\n")


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `predicate` every 0.5 s; fail the test after `timeout_s` (a bound, not a speed assumption)."""
    import pytest

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.5)


def write_sweep(folder: Path, body: str, name: str = "sweep.yaml") -> Path:
    """A sweep file with tiny, warm-start-free defaults under `folder`; `body` adds sections."""
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


class FakeScheduler:
    """A SLURM-like executor in memory (kind "slurm" unless told): one "array" per submit."""

    def __init__(self, delay: int = 1, kind: str = "slurm", run_stages: bool = False):
        self.kind, self.delay, self.run_stages = kind, delay, run_stages
        self.jobs: dict[str, str] = {}
        self.tasks: dict[str, Task] = {}
        self.age: dict[str, int] = {}
        self.submits: list[tuple[list[str], str | None]] = []  # (task names, dependency) per sbatch
        self.polls: list[int] = []  # number of handles per poll call
        self.cancels: list[list[str]] = []
        self.on_poll: Callable[[FakeScheduler], None] | None = None
        self.fail_names: set[str] = set()  # tasks of these names fail without running
        self._ids = itertools.count(100)

    def slots(self, running: int) -> int:
        return 1_000_000

    def submit(self, tasks: Sequence[Task], dependency: str | None = None) -> list[JobHandle]:
        array = next(self._ids)
        self.submits.append(([t.name for t in tasks], dependency))
        handles = []
        for i, t in enumerate(tasks):
            jid = f"{array}_{i}" if len(tasks) > 1 else str(array)
            self.jobs[jid], self.tasks[jid], self.age[jid] = PENDING, t, 0
            handles.append(JobHandle(t.name, jid, self.kind, None, None))
        return handles

    def _advance(self, jid: str) -> None:
        if self.jobs.get(jid) not in (PENDING, RUNNING):
            return
        self.age[jid] += 1
        if self.age[jid] < self.delay:
            self.jobs[jid] = RUNNING
            return
        task = self.tasks.get(jid)
        if task is not None and task.name in self.fail_names:
            self.jobs[jid] = FAILED
        elif task is not None and (isinstance(task.fn, CellJob) or self.run_stages):
            try:
                task.fn(*task.args)
                self.jobs[jid] = DONE
            except Exception:
                self.jobs[jid] = FAILED
        else:
            self.jobs[jid] = DONE

    def poll(self, handles: Sequence[JobHandle]) -> dict[str, str]:
        self.polls.append(len(handles))
        if self.on_poll:
            self.on_poll(self)
        for h in handles:
            self._advance(h.job_id)
        return {h.job_id: self.jobs.get(h.job_id, UNKNOWN) for h in handles}

    def cancel(self, handles: Sequence[JobHandle]) -> None:
        self.cancels.append([h.job_id for h in handles])
        for h in handles:
            if self.jobs.get(h.job_id) in (PENDING, RUNNING):
                self.jobs[h.job_id] = CANCELLED

    def queued(self, handles: Sequence[JobHandle]) -> list[str]:
        return [h.job_id for h in handles if self.jobs.get(h.job_id) in (PENDING, RUNNING)]
