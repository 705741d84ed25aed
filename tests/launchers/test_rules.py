"""The one rules table (launchers/plan/rules.py): plan, run and status read a cell's state alike.

The regression it pins: a SCHEDULED/RUNNING cell whose job is dead used to read "wait" in `sweep
plan` while `sweep run` relaunched it. And: an attempt lost because the driver itself died does not
count against the cell's retries; a killed cell's logged steps reach MLflow before it is marked KILLED.
"""
from __future__ import annotations

import io

import pytest
from _sweep_fakes import FakeScheduler, fake_run, mlflow_db, write_sweep
from mlflow import MlflowClient

import launchers.executors
from fp8rl_core.tracking.mlflow_sink import MlflowSink
from launchers.executors import FAILED
from launchers.plan import rules
from launchers.plan.cells import CELLS_SUBFOLDER
from launchers.plan.render import action_for
from launchers.run.cell_facts import driver_session, settle
from launchers.run.driver import run_sweep
from launchers.run.state import Attempt, CellRecord, load_state
from launchers.run.status import plan_states
from launchers.sweepfile.loading import load_sweep

SWEEP = """\
experiment: rules
base:
  train: {steps: 3}
  warmstart: {steps: 0}
grid:
  optim.lr: [0.001]
launcher: {kind: slurm, retries: RETRIES}
tracking: {uri: "sqlite:///mlflow.db"}
"""


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_every_state_has_one_action_and_one_plan_word():
    assert {a for a, _ in rules.RULES.values()} == {rules.RUN, rules.WAIT, rules.SKIP, rules.EXHAUSTED}
    for state, (action, word) in rules.RULES.items():
        assert rules.action_of(state) == action and action_for(state) == word


@pytest.mark.parametrize("mlflow,outcomes,job,state", [
    ("RUNNING", [None], "failed", "killed"),  # the job died under a RUNNING run
    ("SCHEDULED", [None], "unknown", "killed"),  # it died before the run started
    ("RUNNING", [], None, "killed"),  # a run with no job of ours at all
    ("SCHEDULED", [], None, "scheduled"),  # created, never submitted
    ("RUNNING", [None], "running", "running"),
    ("FAILED", [None], "pending", "pending"),  # requeued: the live job wins
])
def test_open_runs_without_a_live_job_are_run_again(mlflow, outcomes, job, state):
    rec = CellRecord("r", [Attempt(str(i), "slurm", 0.0, outcome=o) for i, o in enumerate(outcomes)])
    settled = CellRecord("r", [Attempt(a.job_id, a.kind, a.submitted, outcome=a.outcome) for a in rec.attempts])
    settle(settled, mlflow, job)
    assert rules.cell_state(mlflow, settled, job, retries=1) == state
    assert rules.decide(mlflow, settled, job, 1) == (rules.WAIT if state in ("running", "pending") else rules.RUN)


def test_plan_and_run_agree_on_a_running_cell_whose_job_died(cwd, monkeypatch, capsys):
    mlflow_db(cwd / "mlflow.db")
    path = write_sweep(cwd, SWEEP.replace("RETRIES", "1"))
    sweep = load_sweep(path)
    fake = FakeScheduler(delay=1000)
    monkeypatch.setattr(launchers.executors, "make_executor", lambda sweep, kind=None: fake)
    assert run_sweep(sweep, executor=fake, run_fn=fake_run, out=io.StringIO(), detach=True) == 0
    (cell_id,) = load_state(sweep.folder).cells
    run_id = load_state(sweep.folder).cells[cell_id].run_id
    MlflowClient(sweep.tracking_uri()).update_run(run_id, "RUNNING")  # the job had started its run
    for jid in fake.jobs:
        fake.jobs[jid] = FAILED  # then died without a word (node failure): sacct says FAILED

    assert plan_states(sweep)([cell_id]) == {cell_id: "killed"}
    from launchers.cli import main

    assert main(["plan", str(path)]) == 0
    assert "killed  rerun" in capsys.readouterr().out  # was: running -> wait
    fake.delay = 1
    out = io.StringIO()
    assert run_sweep(sweep, executor=fake, run_fn=fake_run, out=out, poll_s=0, report=False) == 0
    assert "1 run" in out.getvalue() and len(fake.submits) == 3  # cells+report when detached, then the rerun


def test_a_killed_cell_keeps_every_logged_step_and_ends_killed(cwd, monkeypatch):
    """Killed between two shipments of its sink: the driver ships its metrics.jsonl, then marks it KILLED."""
    mlflow_db(cwd / "mlflow.db")
    sweep = load_sweep(write_sweep(cwd, SWEEP.replace("RETRIES", "0")))
    fake = FakeScheduler(delay=1000)
    monkeypatch.setattr(launchers.executors, "make_executor", lambda sweep, kind=None: fake)
    assert run_sweep(sweep, executor=fake, run_fn=fake_run, out=io.StringIO(), detach=True) == 0
    (cell_id, rec), = load_state(sweep.folder).cells.items()
    sink = MlflowSink(sweep.tracking_uri(), rec.run_id, sweep.folder / CELLS_SUBFOLDER / cell_id / "metrics.jsonl",
                      background=False)
    sink.log(1, {"loss": 1.0})
    assert sink.flush(10.0)  # shipment 1
    sink.log(2, {"loss": 0.5})
    sink.log(3, {"loss": 0.3})
    del sink  # SIGKILL before shipment 2
    for jid in fake.jobs:
        fake.jobs[jid] = FAILED
    assert run_sweep(sweep, executor=fake, run_fn=fake_run, out=io.StringIO(), poll_s=0, report=False) == 1
    client = MlflowClient(sweep.tracking_uri())
    assert sorted(m.step for m in client.get_metric_history(rec.run_id, "loss")) == [1, 2, 3]
    assert client.get_run(rec.run_id).info.status == "KILLED"


@pytest.mark.parametrize("driver,mlflow,outcome,failures", [
    ("4242-0", "RUNNING", "lost", 0),  # a local job that died with its (other, dead) driver
    ("4242-0", "FAILED", "failed", 1),  # it failed by itself before the driver died
    ("SELF", "RUNNING", "failed", 1),  # this driver saw it die: OOM, SIGKILL
    (None, "RUNNING", "failed", 1),  # a record from before sessions were written
])
def test_an_attempt_lost_with_its_driver_does_not_count(driver, mlflow, outcome, failures):
    rec = CellRecord("r", [Attempt("77", "local", 0.0, driver=driver_session() if driver == "SELF" else driver)])
    assert settle(rec, mlflow, "unknown")
    assert rec.last().outcome == outcome and rec.failures() == failures
    slurm = CellRecord("r", [Attempt("77", "slurm", 0.0, driver="4242-0")])  # SLURM jobs outlive drivers
    settle(slurm, mlflow, "failed")
    assert slurm.failures() == 1
