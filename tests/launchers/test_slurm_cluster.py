"""submitit 1.5 against the real local SLURM cluster (scripts/slurm/cluster.sh up).

What the sweep engine relies on: results come back, arrays honour their parallelism, job states come
from sacct (accounting), failures carry their traceback, cancel empties the queue, and a preempted
Checkpointable job checkpoints, requeues and resumes. Every wait is bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
import submitit
from _sweep_fakes import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# Test modules are not importable inside the job (rootdir-based collection): ship this one by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ---- job callables (they run inside SLURM jobs) -------------------------------------------------


def square_in_job(x: int) -> tuple[int, str]:
    return x * x, os.environ["SLURM_JOB_ID"]


def timed_square(x: int, seconds: float) -> tuple[int, float, float]:
    start = time.time()
    time.sleep(seconds)
    return x * x, start, time.time()


def fail_with(message: str) -> None:
    raise ValueError(message)


def hold_memory(n_bytes: int, seconds: float) -> int:
    block = bytearray(n_bytes)  # zero-filled, so resident
    time.sleep(seconds)
    return len(block)


class StepCounter(submitit.helpers.Checkpointable):
    """Counts to `n_steps`, appending one line `step restart_count` per step to `progress`.

    It resumes from the file (as a run resumes from its own checkpoint), so a requeued job continues
    where it stopped; the default checkpoint() resubmits the same callable and arguments. The first
    attempt waits after `hold_at` lines until the file `release` exists, so the test preempts it
    mid-run on any machine.
    """

    def __call__(self, progress: str, n_steps: int, step_s: float, hold_at: int = -1,
                 release: str = "") -> list[int]:
        path = Path(progress)
        done = path.read_text().split("\n")[:-1] if path.exists() else []
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        for step in range(len(done), n_steps):
            if step == hold_at and restart == "0":
                while not Path(release).exists():
                    time.sleep(0.1)
            time.sleep(step_s)
            with path.open("a") as f:
                f.write(f"{step} {restart} {time.time():.3f}\n")
        return [int(line.split()[0]) for line in path.read_text().splitlines()]


# ---- helpers -------------------------------------------------------------------------------------


def make_executor(folder: Path, partition: str, **params: object) -> submitit.AutoExecutor:
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(
        timeout_min=5, slurm_partition=partition, cpus_per_task=1, mem_gb=1, **params
    )
    return executor


_ACTIVE_STATES = {"UNKNOWN", "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED"}


def sacct_state(job: submitit.Job) -> str:
    """The job's state as sacct reports it now (job.state is cached and may be stale)."""
    return job.get_info(mode="force").get("State", "UNKNOWN")


def final_state(job: submitit.Job, timeout_s: float = 30) -> str:
    """The job's terminal state in sacct: the result file appears a moment before the job ends."""
    deadline = time.monotonic() + timeout_s
    while (state := sacct_state(job)) in _ACTIVE_STATES and time.monotonic() < deadline:
        time.sleep(0.5)
    return state


def wait_done(job: submitit.Job, timeout_s: float) -> None:
    """Wait for the job to end; on timeout cancel it and fail with its log."""
    deadline = time.monotonic() + timeout_s
    while not job.done(force_check=True):
        if time.monotonic() > deadline:
            job.cancel(check=False)
            pytest.fail(f"job {job.job_id} not done after {timeout_s}s: {sacct_state(job)}\n{job.stderr()}")
        time.sleep(1)




def in_squeue(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%i %T"], capture_output=True, text=True)
    return bool(out.stdout.strip())


@pytest.fixture
def cleanup() -> Iterator[list[submitit.Job]]:
    """Jobs a test appends here are cancelled when it ends, so that a failed test frees the node."""
    jobs: list[submitit.Job] = []
    yield jobs
    for job in jobs:
        if not job.done(force_check=True):
            job.cancel(check=False)


# ---- tests ---------------------------------------------------------------------------------------


def test_submit_returns_the_result_from_a_slurm_job(slurm_cluster, tmp_path: Path) -> None:
    job = make_executor(tmp_path, slurm_cluster.partition).submit(square_in_job, 7)
    wait_done(job, 60)
    value, job_id = job.result()
    assert (value, job_id) == (49, job.job_id)
    assert final_state(job) == "COMPLETED"


def test_array_respects_parallelism_and_sacct_reports_every_task(slurm_cluster, tmp_path: Path) -> None:
    executor = make_executor(tmp_path, slurm_cluster.partition, slurm_array_parallelism=2)
    jobs = executor.map_array(timed_square, [1, 2, 3], [3.0] * 3)
    assert "--array=0-2%2" in jobs[0].paths.submission_file.read_text()
    for job in jobs:
        wait_done(job, 90)
    results = [job.result() for job in jobs]
    assert [r[0] for r in results] == [1, 4, 9]
    assert [final_state(job) for job in jobs] == ["COMPLETED"] * 3
    # Two 1-CPU tasks share the node (cons_tres + DefMemPerCPU); the third waits for a slot.
    times = sorted(t for _, start, end in results for t in ((start, 1), (end, -1)))
    running, peak = 0, 0
    for _, delta in times:
        running += delta
        peak = max(peak, running)
    assert peak == 2, f"at most {peak} task(s) ran at once; expected exactly 2 (is the node busy?)"


def test_failing_job_raises_with_its_traceback(slurm_cluster, tmp_path: Path) -> None:
    job = make_executor(tmp_path, slurm_cluster.partition).submit(fail_with, "boom-1234")
    wait_done(job, 60)
    with pytest.raises(submitit.core.utils.FailedJobError) as info:
        job.result()
    assert "ValueError: boom-1234" in str(info.value)
    assert "fail_with" in str(info.value)  # the traceback names the failing frame
    assert final_state(job) == "FAILED"


def test_cancel_leaves_nothing_in_squeue(slurm_cluster, tmp_path: Path, cleanup) -> None:
    job = make_executor(tmp_path, slurm_cluster.partition).submit(time.sleep, 300)
    cleanup.append(job)
    wait_for(lambda: sacct_state(job) == "RUNNING", 60, f"job {job.job_id} to run")
    job.cancel(check=True)
    wait_for(lambda: not in_squeue(job.job_id), 60, f"job {job.job_id} to leave squeue")
    assert final_state(job).startswith("CANCELLED")
    # With accounting, a cancelled job's result() ends (without it, it waits for ever).
    assert job.done(force_check=True)
    job._results_timeout_s = 1  # submitit waits 15 s for a result file that a slow NFS may show late
    with pytest.raises(submitit.core.utils.UncompletedJobError):
        job.result()


def test_memory_limit_is_enforced_without_cgroups(slurm_cluster, tmp_path: Path) -> None:
    # OverMemoryKill: the accounting poller kills a step above its --mem (no cgroup does it here).
    executor = make_executor(tmp_path, slurm_cluster.partition)
    executor.update_parameters(mem_gb=0.25)
    start = time.monotonic()
    job = executor.submit(hold_memory, 1 << 29, 60.0)
    wait_done(job, 45)
    assert time.monotonic() - start < 30, "the job was not killed promptly at its memory limit"
    assert final_state(job) in {"FAILED", "OUT_OF_MEMORY"}
    assert "exceeded memory limit" in job.stderr()


def test_preempted_checkpointable_job_requeues_and_resumes(slurm_cluster, tmp_path: Path, cleanup) -> None:
    progress = tmp_path / "progress.txt"
    n_steps = 30
    release = tmp_path / "release"  # never written: the first attempt waits after 3 steps until preempted
    job = make_executor(tmp_path, slurm_cluster.partition).submit(StepCounter(), str(progress), n_steps, 0.25,
                                                                  3, str(release))
    cleanup.append(job)

    def lines() -> list[list[str]]:
        return [line.split() for line in progress.read_text().splitlines()] if progress.exists() else []

    wait_for(lambda: len(lines()) >= 3, 60, "the first steps")
    assert len(lines()) == 3
    job._interrupt()  # what SLURM does on preemption: SIGTERM, then USR2 -> checkpoint + requeue
    wait_done(job, 120)
    assert job.result() == list(range(n_steps))  # every step once: none lost, none repeated
    steps = lines()
    restarts = sorted({int(restart) for _, restart, _ in steps})
    assert restarts == [0, 1], f"expected one requeue, saw restart counts {restarts}"
    first_after = next(i for i, (_, restart, _) in enumerate(steps) if restart == "1")
    gap = float(steps[first_after][2]) - float(steps[first_after - 1][2])
    print(f"requeue gap (last step before -> first step after): {gap:.1f}s")
    # cred_expire=10 + a short sched_interval give ~13 s; SLURM's defaults give ~150 s. The bound sits
    # between the two with room for a loaded 2-core machine (a configuration check, not a benchmark).
    assert gap < 100, f"the requeued job restarted {gap:.0f}s later (check AuthInfo/SchedulerParameters)"
    assert final_state(job) == "COMPLETED"
