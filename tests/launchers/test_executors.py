"""Executors (launchers/executors/): one array per batch, one sacct per poll, one scancel per cancel,
our concurrency limit for local processes, the debug executor in-process.

SLURM submission goes through submitit's own SlurmExecutor with its mocked `sbatch`
(submitit.slurm.test_slurm.mocked_slurm); sacct/scancel/squeue go through a recording `run_cmd`.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from launchers.executors import CANCELLED, DONE, FAILED, PENDING, RUNNING, UNKNOWN, JobHandle, Task, make_executor
from launchers.executors.debug import DebugExecutor
from launchers.executors.local import LocalExecutor, controller_alive
from launchers.executors.slurm import SlurmExecutor, parse_sacct
from launchers.executors.slurm.sbatch import SlurmSubmission

# Test modules are not importable inside local jobs (rootdir-based collection): ship by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def add(a: int, b: int) -> int:
    return a + b


def sleep_then(path: str, seconds: float) -> None:
    Path(path).write_text(str(os.getpid()))
    time.sleep(seconds)


def boom() -> None:
    raise ValueError("boom-4711")


class Recorder:
    """run_cmd double: records argument lists, answers from a table by program name."""

    def __init__(self, answers: dict[str, str] | None = None):
        self.calls: list[list[str]] = []
        self.answers = answers or {}

    def __call__(self, argv: list[str]) -> str:
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), "argument lists only"
        self.calls.append(argv)
        return self.answers.get(argv[0], "")


def test_parse_sacct_tasks_ranges_and_reasons():
    text = "\n".join(["12_0|COMPLETED", "12_1|RUNNING", "12_[2-4,7%2]|PENDING", "13|CANCELLED by 0",
                      "14|FAILED", "15_3|OUT_OF_MEMORY", "", "garbage"])
    assert parse_sacct(text) == {"12_0": "COMPLETED", "12_1": "RUNNING", "12_2": "PENDING", "12_3": "PENDING",
                                 "12_4": "PENDING", "12_7": "PENDING", "13": "CANCELLED", "14": "FAILED",
                                 "15_3": "OUT_OF_MEMORY"}


def test_slurm_poll_is_one_sacct_for_every_job(tmp_path):
    rec = Recorder({"sacct": "12_0|COMPLETED\n12_1|REQUEUED\n12_[2-3%2]|PENDING\n13|TIMEOUT\n14|CANCELLED by 0\n"})
    ex = SlurmExecutor(SlurmSubmission(tmp_path / "%j", "python"), run=rec)
    old = time.time() - 3600
    handles = [JobHandle(f"c{i}", j, "slurm", submitted=old) for i, j in
               enumerate(["12_0", "12_1", "12_2", "12_3", "13", "14", "99"])]
    handles.append(JobHandle("new", "100", "slurm"))  # just submitted: sacct does not know it yet
    states = ex.poll(handles[:-2])
    assert len(rec.calls) == 1  # every job known to sacct: one call
    assert rec.calls[0][:6] == ["sacct", "-X", "-n", "-P", "-o", "JobID,State"] and rec.calls[0][-1] == "12,13,14"
    assert states == {"12_0": DONE, "12_1": PENDING, "12_2": PENDING, "12_3": PENDING, "13": FAILED,
                      "14": CANCELLED}
    rec.answers["squeue"] = "12_4|RUNNING\n"
    states = ex.poll(handles + [JobHandle("late", "12_4", "slurm", submitted=old)])
    assert [c[0] for c in rec.calls[1:]] == ["sacct", "squeue"]  # squeue only for what sacct lacks
    assert rec.calls[2] == ["squeue", "-h", "-r", "-o", "%i|%T", "-j", "12,99,100"]
    assert (states["12_4"], states["99"], states["100"]) == (RUNNING, UNKNOWN, PENDING)


def test_slurm_cancel_is_one_scancel(tmp_path):
    rec = Recorder()
    ex = SlurmExecutor(SlurmSubmission(tmp_path / "%j", "python"), run=rec)
    ex.cancel([JobHandle("a", "12_0", "slurm"), JobHandle("b", "12_1", "slurm"), JobHandle("w", "11", "slurm")])
    assert rec.calls == [["scancel", "11", "12_0", "12_1"]]


@pytest.mark.parametrize("n", [1, 5])
def test_slurm_batch_is_one_sbatch_array_with_parallelism_and_dependency(tmp_path, n):
    from submitit.slurm.test_slurm import mocked_slurm

    sub = SlurmSubmission(tmp_path / "jobs" / "%j", "python", {"job_name": "t", "time": 5, "array_parallelism": 2,
                                                              "additional_parameters": {"mail-type": "END"}})
    with mocked_slurm() as mock:
        ex = SlurmExecutor(sub)
        handles = ex.submit([Task(f"c{i}", add, (i, 1)) for i in range(n)], "afterok:11")
        assert ex.sbatch_calls == 1 and mock.job_count == 13  # one sbatch, whatever n
    assert [h.name for h in handles] == [f"c{i}" for i in range(n)]
    assert [h.job_id for h in handles] == (["12"] if n == 1 else [f"12_{i}" for i in range(n)])
    sbatch = next((tmp_path / "jobs").rglob("*submission.sh")).read_text()
    assert ("#SBATCH --array=0-4%2" in sbatch) == (n > 1)
    assert "#SBATCH --dependency=afterok:11" in sbatch and "#SBATCH --kill-on-invalid-dep=yes" in sbatch
    assert "#SBATCH --mail-type=END" in sbatch
    assert all(h.stderr and h.stderr.endswith("_log.err") for h in handles)


def test_slurm_queued_reads_squeue_once(tmp_path):
    rec = Recorder({"squeue": "12_1\n13\n"})
    ex = SlurmExecutor(SlurmSubmission(tmp_path / "%j", "python"), run=rec)
    assert ex.queued([JobHandle("a", "12_1", "slurm"), JobHandle("b", "13", "slurm")]) == ["12_1", "13"]
    assert rec.calls == [["squeue", "-h", "-r", "-o", "%i", "-j", "12,13"]]


def test_debug_runs_in_process_and_keeps_the_traceback(tmp_path, capsys):
    ex = DebugExecutor(tmp_path)
    ok, bad = ex.submit([Task("a", add, (1, 2)), Task("b", boom)])
    assert ex.poll([ok, bad]) == {ok.job_id: DONE, bad.job_id: FAILED}
    assert "ValueError: boom-4711" in Path(bad.stderr).read_text()
    assert "boom-4711" in capsys.readouterr().err


def test_local_executor_limits_concurrency_polls_and_cancels(tmp_path):
    ex = LocalExecutor(tmp_path, max_parallel=2)
    assert ex.slots(0) == 2 and ex.slots(1) == 1 and ex.slots(2) == 0
    marks = [tmp_path / f"m{i}" for i in range(2)]
    quick, slow = ex.submit([Task("q", add, (2, 3)), Task("s", sleep_then, (str(marks[1]), 60.0))])
    assert controller_alive(int(quick.job_id), tmp_path) and not controller_alive(os.getpid())
    deadline = time.monotonic() + 60
    while ex.poll([quick])[quick.job_id] == RUNNING and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ex.poll([quick, slow]) == {quick.job_id: DONE, slow.job_id: RUNNING}
    while not marks[1].exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    task_pid = int(marks[1].read_text())
    other = LocalExecutor(tmp_path, max_parallel=2)  # another shell: knows the job only by its pid
    assert other.poll([slow]) == {slow.job_id: RUNNING}
    other.cancel([slow])
    assert ex.wait([slow], 30)
    assert not Path(f"/proc/{task_pid}").exists() or "Z" in Path(f"/proc/{task_pid}/stat").read_text().split()[2]
    assert other.poll([slow]) == {slow.job_id: UNKNOWN}  # gone; its outcome is MLflow's to tell


def test_make_executor_by_kind(tmp_path, monkeypatch):
    from launchers.sweepfile.loading import load_sweep_text

    text = "experiment: e\ngrid: {seed: [0]}\nlauncher: {kind: %s, max_parallel: 3}\n"
    for kind, cls in (("local", LocalExecutor), ("debug", DebugExecutor), ("slurm", SlurmExecutor)):
        ex = make_executor(load_sweep_text(text % kind, cwd=tmp_path))
        assert isinstance(ex, cls) and ex.kind == kind
    local = make_executor(load_sweep_text(text % "local", cwd=tmp_path))
    assert local.max_parallel == 3 and local.folder == tmp_path / "outputs" / "e"
    slurm = make_executor(load_sweep_text(text % "slurm", cwd=tmp_path))
    assert slurm.submission.parameters["array_parallelism"] == 3


def _sigint_ignored_in_child(restore: bool) -> tuple[bool, bool]:
    """Start Python with SIGINT ignored (as `nohup ... &` does); optionally restore_sigint(); then
    report (KeyboardInterrupt handler installed?, SIGINT ignored in a process it starts?)."""
    import signal
    import subprocess
    import sys

    code = ("import signal, subprocess\n"
            "from launchers.process import restore_sigint\n"
            f"{'restore_sigint()' if restore else ''}\n"
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n"
            "print(subprocess.run(['grep', 'SigIgn', '/proc/self/status'], capture_output=True, text=True).stdout)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)).stdout.split("\n")
    return out[0] == "True", bool(int(out[1].split()[1], 16) & (1 << (signal.SIGINT - 1)))


def test_restore_sigint_makes_processes_cancellable_under_nohup():
    assert _sigint_ignored_in_child(restore=False) == (False, True)  # the trap: children ignore SIGINT too
    assert _sigint_ignored_in_child(restore=True) == (True, False)


@pytest.mark.parametrize("n", [1, 3])
def test_the_sweep_files_max_num_timeout_is_every_submitted_jobs_requeue_countdown(tmp_path, n):
    """launcher.slurm.max_num_timeout reaches submitit's countdown of every job, arrays included: without
    it a cell gets submitit's default 3 requeues (4 x `time` in all) whatever the sweep file says."""
    from submitit.core.utils import DelayedSubmission
    from submitit.slurm.test_slurm import mocked_slurm

    from launchers.executors.slurm.sbatch import slurm_submission
    from launchers.sweepfile.loading import load_sweep

    path = tmp_path / "s.yaml"
    path.write_text("experiment: t\nbase: {model: {preset: tiny}}\ngrid: {seed: [0]}\n"
                    "launcher: {kind: slurm, slurm: {time: 5, max_num_timeout: 40}}\n")
    sub = slurm_submission(load_sweep(path, cwd=tmp_path))
    with mocked_slurm():
        SlurmExecutor(sub).submit([Task(f"c{i}", add, (i, 1)) for i in range(n)])
    pickles = sorted((tmp_path / "outputs").rglob("*_submitted.pkl"))
    assert len(pickles) == n
    assert [DelayedSubmission.load(p)._timeout_countdown for p in pickles] == [40] * n


def test_a_negative_max_num_timeout_is_refused_with_its_key(tmp_path):
    from launchers.sweepfile.loading import load_sweep
    from launchers.sweepfile.schema import SweepError

    path = tmp_path / "s.yaml"
    path.write_text("experiment: t\nbase: {model: {preset: tiny}}\ngrid: {seed: [0]}\n"
                    "launcher: {kind: slurm, slurm: {max_num_timeout: -1}}\n")
    with pytest.raises(SweepError, match="launcher.slurm.max_num_timeout.*>= 0"):
        load_sweep(path, cwd=tmp_path)


