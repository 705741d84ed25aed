"""`sweep status`, `sweep cancel`, `sweep plan`'s MLflow states, the sweep state file and progress.

MLflow is a real SQLite store; the scheduler is `_sweep_fakes.FakeScheduler`, put in place of the
executors that status/cancel would build (`launchers.executors.make_executor`).
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _sweep_fakes import FakeScheduler, fake_run, mlflow_db, tiny_core_base, write_sweep
from mlflow import MlflowClient

import launchers.executors
from launchers.plan.grid import expand
from launchers.run.cancel import cancel_sweep, driver_pids, stop_drivers
from launchers.run.driver import run_sweep
from launchers.run.progress import cell_step, error_tail, eta_seconds
from launchers.run.state import (
    Attempt,
    CellRecord,
    DriverBusy,
    DriverLock,
    SweepState,
    is_locked,
    load_state,
    save_state,
)
from launchers.run.status import collect, render, sweep_status
from launchers.sweepfile.loading import load_sweep

REPO = Path(__file__).resolve().parents[2]
SWEEP = """\
experiment: st
base:
  train: {steps: 3}
  warmstart: {steps: 0}
grid:
  optim.lr: [0.001, 0.9]
launcher: {kind: debug, retries: 0}
tracking: {uri: "sqlite:///mlflow.db"}
"""


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_status_of_a_sweep_that_never_ran_creates_nothing(cwd):
    sweep = load_sweep(write_sweep(cwd, SWEEP))
    out = io.StringIO()
    assert sweep_status(sweep, out) == 0
    text = out.getvalue()
    assert "2 cells: 2 new" in text and "never run" in text
    assert sorted(p.name for p in cwd.iterdir()) == ["sweep.yaml"]


def test_status_shows_states_steps_and_the_error_of_the_failed_cell(cwd, capsys):
    mlflow_db(cwd / "mlflow.db")
    path = write_sweep(cwd, SWEEP)
    sweep = load_sweep(path)
    assert run_sweep(sweep, run_fn=fake_run, out=io.StringIO(), poll_s=0, report=False) == 1
    cells, rows, _ = collect(sweep)
    by_lr = {r["cell"].params["optim.lr"]: r for r in rows}
    assert by_lr[0.001]["state"] == "finished" and by_lr[0.001]["step"].step == 3
    assert by_lr[0.9]["state"] == "exhausted"
    assert by_lr[0.9]["error"].startswith("RuntimeError: impossible lr 0.9 (at tests/launchers/_sweep_fakes.py:")
    text = render(sweep, cells, rows, None)
    assert "3/3" in text and "RuntimeError: impossible lr 0.9" in text
    from launchers.cli import main

    assert main(["plan", str(path)]) == 0
    plan = capsys.readouterr().out
    assert "finished   skip" in plan and "exhausted  skip (retries used up)" in plan


def _detached(cwd: Path, fake: FakeScheduler, monkeypatch) -> object:
    mlflow_db(cwd / "mlflow.db")
    sweep = load_sweep(write_sweep(cwd, SWEEP.replace("kind: debug", "kind: slurm").replace("0.9]", "0.002]")))
    monkeypatch.setattr(launchers.executors, "make_executor", lambda sweep, kind=None: fake)
    assert run_sweep(sweep, executor=fake, run_fn=fake_run, out=io.StringIO(), detach=True) == 0
    return sweep


def test_cancel_scancels_everything_at_once_and_kills_the_runs(cwd, monkeypatch):
    fake = FakeScheduler(delay=1000)
    sweep = _detached(cwd, fake, monkeypatch)
    _, rows, _ = collect(sweep)
    assert [r["state"] for r in rows] == ["running", "running"]  # sweep status while they run
    out = io.StringIO()
    assert cancel_sweep(sweep, out) == 0
    assert len(fake.cancels) == 1 and len(fake.cancels[0]) == 3  # 2 cells + the report stage, one call
    assert "nothing left in the queue" in out.getvalue()
    state = load_state(sweep.folder)
    client = MlflowClient(sweep.tracking_uri())
    for cell in expand(sweep):
        rec = state.cells[cell.id]
        assert rec.last().outcome == "cancelled" and rec.failures() == 0
        assert client.get_run(rec.run_id).info.status == "KILLED"
    assert client.get_run(state.parent_run_id).info.status == "KILLED"
    fake2 = FakeScheduler(delay=0)
    assert run_sweep(sweep, executor=fake2, run_fn=fake_run, out=io.StringIO(), poll_s=0, report=False) == 0
    assert len(fake2.submits) == 1 and len(fake2.submits[0][0]) == 2  # resumed, not counted as failures


def test_cancel_reads_the_runs_with_one_query_before_and_one_after(cwd, monkeypatch):
    fake = FakeScheduler(delay=1000)
    sweep = _detached(cwd, fake, monkeypatch)
    calls = {"get_run": 0, "search_runs": 0}
    for name in calls:
        real = getattr(MlflowClient, name)

        def counted(self, *a, _name=name, _real=real, **k):
            calls[_name] += 1
            return _real(self, *a, **k)
        monkeypatch.setattr(MlflowClient, name, counted)
    assert cancel_sweep(sweep, io.StringIO()) == 0
    assert calls == {"get_run": 0, "search_runs": 2}  # not 2 get_run per cell


def test_status_watch_returns_once_nothing_is_alive(cwd, monkeypatch):
    fake = FakeScheduler(delay=3)
    sweep = _detached(cwd, fake, monkeypatch)
    out = io.StringIO()
    assert sweep_status(sweep, out, watch=True, interval_s=0.01) == 0
    assert out.getvalue().count("sweep st: 2 cells") >= 2 and "2 finished" in out.getvalue()


def test_cancel_stops_the_driver_first(cwd):
    sweep = load_sweep(write_sweep(cwd, SWEEP))
    sweep.folder.mkdir(parents=True)
    # A stand-in driver: it holds the sweep's lock, and its argv names launchers.
    code = ("import sys, time; from pathlib import Path; from launchers.run.state import DriverLock\n"
            "with DriverLock(Path(sys.argv[1])):\n    print('locked', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(sweep.folder), "launchers.cli"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"locked\n"
        assert driver_pids(sweep) == [proc.pid]
        assert stop_drivers([proc.pid], 10) == []
        assert proc.wait(10) == -15
    finally:
        proc.kill()
    assert driver_pids(sweep) == []  # the lock file still names the pid, but nobody holds the lock
    assert (sweep.folder / ".driver.lock").read_text() == f"pid {proc.pid}\n"


def test_error_tail_finds_the_exception_among_log_noise(tmp_path):
    log = tmp_path / "x_log.err"
    log.write_text("\n".join([
        "submitit INFO (2026-01-01 00:00:00,000) - Starting with JobEnvironment(...)",
        " 40%|####      | 2/5 [00:01<00:02]",
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/submitit/core/submission.py", line 55, in process_job',
        "    result = delayed.result()",
        f'  File "{REPO}/fp8rl_core/model/config.py", line 34, in __post_init__',
        "    raise ValueError(",
        "ValueError: num_attention_heads (4) must be a multiple of num_key_value_heads (3)",
        "submitit ERROR (2026-01-01 00:00:01,000) - Submitted job triggered an exception",
        "srun: error: node1: task 0: Exited with exit code 1", ""]))
    assert error_tail(log) == ("ValueError: num_attention_heads (4) must be a multiple of num_key_value_heads (3) "
                               "(at fp8rl_core/model/config.py:34 in __post_init__)")
    plain = tmp_path / "plain.err"
    plain.write_text("slurmstepd: error: Detected 1 oom_kill event\nKilled\n")
    assert error_tail(plain) == "slurmstepd: error: Detected 1 oom_kill event | Killed"
    assert error_tail(tmp_path / "missing.err") is None and error_tail(None) is None


def test_cell_step_reads_the_tail_and_the_rate(tmp_path):
    lines = [{"kind": "params", "values": {}}] + [
        {"kind": "metrics", "step": s, "time_ms": 1000 * (10 + 2 * s), "values": {"loss": 1.0}} for s in range(0, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"kind": "metr')
    info = cell_step(tmp_path)
    assert info.step == 5 and info.seconds_per_step() == pytest.approx(2.0)
    assert cell_step(tmp_path / "nothing").step == -1
    assert eta_seconds(10, [2.0, 4.0, 3.0], 2) == pytest.approx(15.0)
    assert eta_seconds(0, [], 1) == 0.0 and eta_seconds(5, [None], 1) is None


def test_state_round_trip_is_atomic_and_checked(tmp_path):
    state = SweepState("e", parent_run_id="p", kind="slurm")
    state.cells["c1"] = CellRecord("r1", [Attempt("12_0", "slurm", 1.0, "/x.err", "failed", "boom")], {"seed": 0})
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state
    assert [p.name for p in tmp_path.iterdir()] == ["sweep_state.json"]  # no temp file left behind
    assert load_state(tmp_path / "none") is None
    (tmp_path / "sweep_state.json").write_text("{broken")
    with pytest.raises(ValueError, match="unreadable sweep state"):
        load_state(tmp_path)


def test_driver_lock_is_exclusive_and_visible(tmp_path):
    assert not is_locked(tmp_path)
    with DriverLock(tmp_path):
        assert is_locked(tmp_path)
        with pytest.raises(DriverBusy, match=f"pid {os.getpid()}"):
            DriverLock(tmp_path).__enter__()
    assert not is_locked(tmp_path)
    t0 = time.time()
    with DriverLock(tmp_path):  # released: taken again at once
        assert time.time() - t0 < 1


TINY_LONG = "experiment: bg\n" + tiny_core_base(steps=500, val_every=100) + """\
grid:
  seed: [0, 1]
launcher: {kind: local, max_parallel: 2, retries: 0}
tracking: {uri: "sqlite:///mlflow.db"}
"""


@pytest.mark.slow
def test_local_detach_then_cancel_stops_the_driver_and_its_processes(cwd, capsys, monkeypatch):
    """`sweep run --detach` (a background driver, real core) -> `sweep status` -> `sweep cancel`."""
    from fp8rl_core.loop.hold import ENV_VAR, holders
    from launchers.cli import main
    from launchers.executors.local import controller_alive

    release = cwd / "never-released"
    monkeypatch.setenv(ENV_VAR, f"1:{release}")  # both cells stay running after step 1
    mlflow_db(cwd / "mlflow.db")
    path = write_sweep(cwd, TINY_LONG)
    assert main(["run", str(path), "--detach"]) == 0
    assert "driver running in the background" in capsys.readouterr().out
    sweep = load_sweep(path)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        state = load_state(sweep.folder)
        if state and len(state.cells) == 2 and holders(release) == 2:  # both inside the hold
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the background sweep did not start: {(sweep.folder / 'driver.log').read_text()[-3000:]}")
    assert is_locked(sweep.folder)
    assert main(["status", str(path)]) == 0
    assert "2 running" in capsys.readouterr().out
    pids = [int(rec.last().job_id) for rec in state.cells.values()]
    assert main(["cancel", str(path)]) == 0
    assert "stopped the sweep's driver" in capsys.readouterr().out
    assert not is_locked(sweep.folder) and not any(controller_alive(p) for p in pids)
    client = MlflowClient(sweep.tracking_uri())
    final = load_state(sweep.folder)
    assert {client.get_run(rec.run_id).info.status for rec in final.cells.values()} == {"KILLED"}
    assert {rec.last().outcome for rec in final.cells.values()} == {"cancelled"}
