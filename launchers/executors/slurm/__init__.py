"""SLURM through submitit: one job array per batch, states from ONE `sacct` per poll, one `scancel`.

The sbatch script is the one `sweep plan` shows (`launchers.executors.slurm.sbatch.slurm_submission`); a
batch of n > 1 tasks is one `sbatch --array=0-(n-1)%max_parallel`. Stage dependencies are sbatch
options: the cells wait for the warm start with `--dependency=afterok:<id>` and
`--kill-on-invalid-dep=yes` (a failed warm start cancels them rather than leaving them pending for
ever). Every scheduler command is an argument list through `run_cmd` (faked in unit tests).
"""
from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from launchers.executors.base import CANCELLED, DONE, FAILED, GRACE_S, PENDING, RUNNING, UNKNOWN, JobHandle, Task
from launchers.executors.slurm.sbatch import SlurmSubmission

RunCmd = Callable[[list[str]], str]
# sacct states -> ours (man sacct, JOB STATE CODES). Anything else is UNKNOWN.
SLURM_STATES = {
    "PENDING": PENDING, "REQUEUED": PENDING, "REQUEUE_HOLD": PENDING, "REQUEUE_FED": PENDING,
    "RESV_DEL_HOLD": PENDING, "SUSPENDED": PENDING, "PREEMPTED": PENDING,  # preempted jobs of ours requeue
    "RUNNING": RUNNING, "CONFIGURING": RUNNING, "COMPLETING": RUNNING, "RESIZING": RUNNING,
    "SIGNALING": RUNNING, "STAGE_OUT": RUNNING,
    "COMPLETED": DONE,
    "FAILED": FAILED, "TIMEOUT": FAILED, "OUT_OF_MEMORY": FAILED, "NODE_FAIL": FAILED, "BOOT_FAIL": FAILED,
    "DEADLINE": FAILED, "REVOKED": FAILED, "SPECIAL_EXIT": FAILED,
    "CANCELLED": CANCELLED,
}
_ARRAY_RANGE = re.compile(r"^(\d+)_\[([0-9,\-%]+)\]$")


def run_cmd(argv: list[str], timeout_s: float = 60.0) -> str:
    """Run a scheduler command (argument list, no shell); its stdout, or RuntimeError with stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:2])} ... failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def base_id(job_id: str) -> str:
    """'123_4' -> '123' (the array), '123' -> '123'."""
    return job_id.split("_", 1)[0]


def _expand(spec: str) -> list[str]:
    """sacct's pending-array notation '0-3,7%2' -> ['0', '1', '2', '3', '7']."""
    out: list[str] = []
    for part in spec.split("%", 1)[0].split(","):
        lo, _, hi = part.partition("-")
        out += [str(i) for i in range(int(lo), int(hi or lo) + 1)]
    return out


def parse_sacct(text: str) -> dict[str, str]:
    """`sacct -X -n -P -o JobID,State` lines -> {job id: SLURM state} (pending array ranges expanded)."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) < 2 or not fields[0]:
            continue
        job, state = fields[0], (fields[1].split() or ["UNKNOWN"])[0].rstrip("+")
        m = _ARRAY_RANGE.match(job)
        for jid in ([f"{m.group(1)}_{t}" for t in _expand(m.group(2))] if m else [job]):
            states[jid] = state
    return states


class SlurmExecutor:
    kind = "slurm"

    def __init__(self, submission: SlurmSubmission, run: RunCmd = run_cmd, executor_factory: Any = None):
        self.submission = submission
        self.run = run
        self._factory = executor_factory  # tests: a submitit-compatible executor class (mocked sbatch)
        self.sbatch_calls = 0  # batches submitted (each is one sbatch)

    def slots(self, running: int) -> int:
        return 1_000_000  # SLURM queues them; the array's %max_parallel limits what runs at once

    def _executor(self, dependency: str | None, ranks: int | None = None) -> Any:
        import submitit

        cls = self._factory or submitit.SlurmExecutor
        # max_num_timeout: how many time-limit requeues submitit allows a job (its default, 3, gives a cell
        # 4 x `time` in all); an array's tasks inherit it (submitit copies it to the array's executor)
        ex = cls(folder=self.submission.folder, python=self.submission.python,
                 max_num_timeout=self.submission.max_num_timeout)
        params = dict(self.submission.parameters)
        if ranks == 1:  # a stage (warm start, report) or a 1-rank cell: one task on one node
            params.update(nodes=1, ntasks_per_node=1)
        if dependency:
            extra = dict(params.get("additional_parameters") or {})
            dep = dependency
            extra["dependency"] = f"{extra['dependency']},{dep}" if extra.get("dependency") else dep
            extra["kill-on-invalid-dep"] = "yes"
            params["additional_parameters"] = extra
        ex.update_parameters(**params)
        return ex

    def submit(self, tasks: Sequence[Task], dependency: str | None = None) -> list[JobHandle]:
        if not tasks:
            return []
        ranks = {t.ranks for t in tasks}
        if len(ranks) > 1:
            raise ValueError(f"one batch (one sbatch) runs tasks of one shape; got ranks {sorted(ranks)}")
        # cells: nodes x tasks_per_node tasks, one rank each (submitit runs the callable on every task)
        ex = self._executor(dependency, 1 if ranks == {1} else None)
        with ex.batch():  # one sbatch: an array when len(tasks) > 1
            jobs = [ex.submit(t.fn, *t.args) for t in tasks]
        self.sbatch_calls += 1
        now = time.time()
        return [JobHandle(t.name, j.job_id, self.kind, str(j.paths.stdout), str(j.paths.stderr), now)
                for t, j in zip(tasks, jobs)]

    def poll(self, handles: Sequence[JobHandle]) -> dict[str, str]:
        """One sacct for every handle. A job sacct does not list (accounting lags the controller,
        and pending array tasks move between records) is looked up in squeue, in one more call
        made only then; one neither knows is pending for GRACE_S after its submission, then gone."""
        if not handles:
            return {}
        ids = sorted({base_id(h.job_id) for h in handles}, key=int)
        raw = parse_sacct(self.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(ids)]))
        missing = [h for h in handles if h.job_id not in raw]
        if missing:
            raw.update(self._squeue_states(missing))
        now = time.time()
        out = {}
        for h in handles:
            state = raw.get(h.job_id)
            if state is None:
                out[h.job_id] = PENDING if now - h.submitted < GRACE_S else UNKNOWN
            else:
                out[h.job_id] = SLURM_STATES.get(state, UNKNOWN)
        return out

    def _squeue_states(self, handles: Sequence[JobHandle]) -> dict[str, str]:
        ids = ",".join(sorted({base_id(h.job_id) for h in handles}, key=int))
        try:
            text = self.run(["squeue", "-h", "-r", "-o", "%i|%T", "-j", ids])
        except RuntimeError as e:  # squeue rejects ids it has forgotten (ended > MinJobAge ago)
            if "Invalid job id" in str(e):
                return {}
            raise
        return parse_sacct(text)

    def cancel(self, handles: Sequence[JobHandle]) -> None:
        """One scancel for all of them (array tasks by id; scancel ignores ids already gone)."""
        if handles:
            self.run(["scancel", *sorted({h.job_id for h in handles})])

    def queued(self, handles: Sequence[JobHandle]) -> list[str]:
        """Ids of `handles` still in squeue (one call): what `sweep cancel` waits to see emptied."""
        if not handles:
            return []
        ids = ",".join(sorted({base_id(h.job_id) for h in handles}, key=int))
        try:
            text = self.run(["squeue", "-h", "-r", "-o", "%i", "-j", ids])
        except RuntimeError as e:  # squeue rejects ids it has forgotten (ended > MinJobAge ago)
            if "Invalid job id" in str(e):
                return []
            raise
        return [line.strip() for line in text.splitlines() if line.strip()]
