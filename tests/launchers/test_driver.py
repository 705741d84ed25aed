"""`sweep run` (launchers/run/driver.py): idempotence, retries, waiting on live jobs, stages, safety.

Cells are `_sweep_fakes.fake_run` (a few logged steps through the real run sink), MLflow is a real
SQLite store in tmp_path, and the scheduler is the debug executor or `FakeScheduler`.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from _sweep_fakes import FakeScheduler, fake_run, tiny_core_base, write_sweep
from mlflow import MlflowClient

from fp8rl_core.tracking.runs import ERROR_TAG
from launchers.plan import rules
from launchers.plan.grid import expand
from launchers.run.cell_facts import job_config, supersede_outputs
from launchers.run.driver import run_sweep
from launchers.run.jobs import CellJob
from launchers.run.state import Attempt, CellRecord, DriverLock, load_state
from launchers.sweepfile.loading import load_sweep
from launchers.sweepfile.schema import SweepError

SWEEP = """\
experiment: drv
base:
  train: {steps: 3}
  warmstart: {steps: 0}
grid:
  seed: [0, 1]
  optim.lr: [0.001, 0.9]
launcher: {kind: debug, retries: 1}
tracking: {uri: "sqlite:///mlflow.db"}
"""


def runs(uri: str, experiment: str = "drv") -> dict[str, object]:
    """cell_id -> the cell's active MLflow run."""
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    found = client.search_runs([exp.experiment_id], "tags.`fp8rl.role` = 'cell'")
    return {r.data.tags["cell_id"]: r for r in found}


def go(sweep, **kw) -> tuple[int, str]:
    out = io.StringIO()
    rc = run_sweep(sweep, run_fn=fake_run, out=out, poll_s=0.0, report=False, **kw)
    return rc, out.getvalue()


def test_runs_every_cell_once_and_a_rerun_submits_nothing(cwd):
    sweep = load_sweep(write_sweep(cwd, SWEEP))
    rc, text = go(sweep)
    assert rc == 1  # the lr=0.9 cells fail (twice: retries 1)
    by_cell = runs(sweep.tracking_uri())
    cells = {c.id: c for c in expand(sweep)}
    assert set(by_cell) == set(cells)
    for cid, run in by_cell.items():
        expected = "FAILED" if cells[cid].params["optim.lr"] == 0.9 else "FINISHED"
        assert run.info.status == expected, (cells[cid].label(), run.info.status)
        tags = run.data.tags
        assert tags["sweep"] == "drv" and tags["seed"] == str(cells[cid].params["seed"])
        assert tags["recipe"] == "bf16" and tags["importance_sampling"] == "none"
        assert tags["mlflow.parentRunId"] == load_state(sweep.folder).parent_run_id
        assert float(run.data.params["optim.lr"]) == cells[cid].params["optim.lr"]
    state = load_state(sweep.folder)
    for cid, cell in cells.items():
        outcomes = [a.outcome for a in state.cells[cid].attempts]
        assert outcomes == (["failed", "failed"] if cell.params["optim.lr"] == 0.9 else ["finished"])
    assert "impossible lr 0.9" in state.cells[next(c for c in cells if cells[c].params["optim.lr"] == 0.9)].last().error
    assert "failed (attempt 2, no retries left)" in text

    fake = FakeScheduler(kind="debug")
    rc, text = go(sweep, executor=fake)
    assert fake.submits == [] and rc == 1
    assert "2 exhausted, 2 skip" in text
    assert {c: r.info.run_id for c, r in runs(sweep.tracking_uri()).items()} == \
        {c: r.info.run_id for c, r in by_cell.items()}  # no new run


def test_a_deleted_run_reruns_only_its_cell_and_keeps_its_old_outputs(cwd):
    sweep = load_sweep(write_sweep(cwd, SWEEP.replace("[0.001, 0.9]", "[0.001]")))
    assert go(sweep)[0] == 0
    before = runs(sweep.tracking_uri())
    victim = sorted(before)[0]
    MlflowClient(sweep.tracking_uri()).delete_run(before[victim].info.run_id)
    fake = FakeScheduler(kind="debug", delay=0)
    rc, text = go(sweep, executor=fake)
    assert rc == 0 and fake.submits == [([victim], None)]
    after = runs(sweep.tracking_uri())
    assert after[victim].info.run_id != before[victim].info.run_id and after[victim].info.status == "FINISHED"
    others = set(before) - {victim}
    assert {c: after[c].info.run_id for c in others} == {c: before[c].info.run_id for c in others}
    moved = list((sweep.folder / "cells" / ".superseded").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith(victim) and (moved[0] / "metrics.jsonl").exists()
    assert "old outputs moved" in text


def test_retry_failed_reruns_exhausted_cells_only(cwd):
    sweep = load_sweep(write_sweep(cwd, SWEEP.replace("retries: 1", "retries: 0")))
    assert go(sweep)[0] == 1
    fake = FakeScheduler(kind="debug", delay=0)
    go(sweep, executor=fake, retry_failed=True)
    lrs = {c.id: c.params["optim.lr"] for c in expand(sweep)}
    assert [lrs[c] for names, _ in fake.submits for c in names] == [0.9, 0.9]


def test_a_sweep_that_fails_validation_creates_nothing(cwd):
    bad = SWEEP.replace("optim.lr: [0.001, 0.9]", "task.min_digits: [1, 3]\n  task.digits: [2, 3]").replace(
        "  train: {steps: 3}", "  train: {steps: 3}\n  task: {digits: 3, min_digits: 1}")
    path = write_sweep(cwd, bad)
    sweep = load_sweep(path)  # each value alone is fine; the (min_digits 3, digits 2) cell is not
    with pytest.raises(SweepError, match="min_digits"):
        go(sweep)
    (cwd / "mlflow.db").unlink()
    assert sorted(p.name for p in cwd.iterdir()) == ["sweep.yaml"]  # no folder, no mlflow.db
    from launchers.cli import main

    assert main(["run", str(path)]) == 2
    assert sorted(p.name for p in cwd.iterdir()) == ["sweep.yaml"]


def test_live_jobs_are_waited_for_with_one_poll_per_tick(cwd):
    sweep = load_sweep(write_sweep(cwd, SWEEP.replace("kind: debug", "kind: slurm").replace("[0.001, 0.9]", "[0.001]")))
    fake = FakeScheduler(delay=4)
    assert go(sweep, executor=fake, detach=True)[0] == 0  # submits the array (and the report stage)
    assert [len(names) for names, _ in fake.submits] == [2, 1]
    array_deps = fake.submits[1][1]
    assert array_deps.startswith("afterany:")
    rc, text = go(sweep, executor=fake)  # a second driver: the jobs are alive -> it waits
    assert rc == 0 and len(fake.submits) == 2, "a cell with a live job was submitted again"
    assert "2 wait" in text
    assert all(runs(sweep.tracking_uri())[c.id].info.status == "FINISHED" for c in expand(sweep))
    assert len(fake.polls) >= 4 and set(fake.polls) == {2}  # one scheduler query per tick, for all jobs


def test_a_dead_job_whose_run_says_running_is_killed_and_counted(cwd):
    sweep = load_sweep(write_sweep(cwd, SWEEP.replace("kind: debug", "kind: slurm").replace(
        "retries: 1", "retries: 0").replace("[0.001, 0.9]", "[0.001]").replace("seed: [0, 1]", "seed: [0]")))
    fake = FakeScheduler(delay=100)
    go(sweep, executor=fake, detach=True)
    (cell,) = expand(sweep)
    state = load_state(sweep.folder)
    run_id = state.cells[cell.id].run_id
    MlflowClient(sweep.tracking_uri()).update_run(run_id, "RUNNING")  # the job opened its sink ...
    fake.jobs[state.cells[cell.id].last().job_id] = "failed"  # ... and died (OOM, node failure)
    rc, text = go(sweep, executor=fake)
    assert rc == 1 and "1 exhausted" in text and len(fake.submits) == 2
    assert MlflowClient(sweep.tracking_uri()).get_run(run_id).info.status == "KILLED"
    last = load_state(sweep.folder).cells[cell.id].last()
    assert last.outcome == "failed" and "with its run RUNNING" in last.error


def test_warm_start_is_one_job_the_cells_depend_on(cwd):
    body = SWEEP.replace("kind: debug", "kind: slurm").replace("warmstart: {steps: 0}",
                                                                "warmstart: {steps: 5, cache_dir: ws}")
    sweep = load_sweep(write_sweep(cwd, body))
    fake = FakeScheduler(delay=100)
    go(sweep, executor=fake, detach=True)
    (ws_names, ws_dep), (cell_names, cell_dep), (report_names, report_dep) = fake.submits
    assert ws_names == ["warmstart"] and ws_dep is None and len(fake.tasks[min(fake.tasks)].args[0]) == 1
    ws_job = next(j for j, t in fake.tasks.items() if t.name == "warmstart")
    assert len(cell_names) == 4 and cell_dep == f"afterok:{ws_job}"
    assert report_names == ["report"] and report_dep == "afterany:" + next(
        j for j, t in fake.tasks.items() if t.name == cell_names[0]).split("_")[0]
    cfg = next(t for t in fake.tasks.values() if t.name == cell_names[0]).args[0]
    assert cfg["warmstart"]["cache_dir"] == str(cwd / "ws")  # absolute: jobs may start elsewhere


def test_a_failed_warm_start_job_is_reported(cwd):
    body = SWEEP.replace("kind: debug", "kind: slurm").replace("warmstart: {steps: 0}",
                                                                "warmstart: {steps: 5, cache_dir: ws}")
    fake = FakeScheduler(delay=1)
    fake.fail_names = {"warmstart"}
    rc, text = go(load_sweep(write_sweep(cwd, body)), executor=fake)
    ws_job = next(j for j, t in fake.tasks.items() if t.name == "warmstart")
    assert f"warm start job {ws_job} failed: no log; SLURM cancels the cells waiting for it" in text


def test_local_warm_start_runs_before_any_cell(cwd, monkeypatch):
    import launchers.run.session as session_mod

    events = []
    monkeypatch.setattr(session_mod, "warm_start_stage", lambda configs: events.append(("warm", len(configs))))
    fake = FakeScheduler(kind="debug", delay=0)
    real_submit = fake.submit
    monkeypatch.setattr(fake, "submit", lambda tasks, dep=None: events.append(("submit", len(tasks))) or
                        real_submit(tasks, dep))
    body = SWEEP.replace("warmstart: {steps: 0}", "warmstart: {steps: 5, cache_dir: ws}")
    go(load_sweep(write_sweep(cwd, body)), executor=fake)
    assert events[0] == ("warm", 1) and events[1][0] == "submit"


def test_a_second_driver_is_refused(cwd):
    sweep = load_sweep(write_sweep(cwd, SWEEP))
    with DriverLock(sweep.folder):
        rc, text = go(sweep)
    assert rc == 3 and "another `sweep run` drives this sweep" in text


@pytest.mark.parametrize("mlflow,outcomes,job,retries,action", [
    (None, [], None, 1, "run"),
    ("FINISHED", ["finished"], None, 1, "skip"),
    ("FAILED", ["failed"], None, 1, "run"),
    ("FAILED", ["failed", "failed"], None, 1, "exhausted"),
    ("KILLED", ["cancelled", "cancelled"], None, 0, "run"),  # cancels do not use up retries
    ("FAILED", ["failed", None], "pending", 1, "wait"),  # requeued: alive wins over a stale FAILED
    ("RUNNING", [None], "running", 0, "wait"),
    ("SCHEDULED", [], None, 0, "run"),
])
def test_decide(mlflow, outcomes, job, retries, action):
    rec = CellRecord("r", [Attempt(str(i), "slurm", 0.0, outcome=o) for i, o in enumerate(outcomes)])
    assert rules.decide(mlflow, rec, job, retries) == action


def test_cell_job_fails_its_run_when_the_cell_cannot_start(cwd):
    from fp8rl_core.tracking.runs import create_parent_run, ensure_experiment, find_or_create_cell_run

    sweep = load_sweep(write_sweep(cwd, SWEEP))
    cell = expand(sweep)[0]
    uri = sweep.tracking_uri()
    exp = ensure_experiment(uri, "drv")
    parent = create_parent_run(uri, "drv", "drv")
    run_id, status = find_or_create_cell_run(uri, exp, parent, cell.id)
    assert status == "SCHEDULED"

    def cannot_build(cfg):
        raise ValueError("num_attention_heads (4) must be a multiple of num_key_value_heads (3)")

    config = job_config(sweep, cell, run_id, parent)
    from fp8rl_core.config.schema import to_dict

    with pytest.raises(ValueError):
        CellJob(cannot_build)(to_dict(config))
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FAILED" and "num_key_value_heads (3)" in run.data.tags[ERROR_TAG]
    job = CellJob(cannot_build)
    delayed = job.checkpoint(to_dict(config))
    assert isinstance(delayed.function, CellJob) and delayed.function is not job
    assert not delayed.function._requeued and delayed.args == (to_dict(config),)


def test_job_config_keeps_the_cell_id_and_makes_paths_absolute(cwd):
    from fp8rl_core.config import run_config_hash

    sweep = load_sweep(write_sweep(cwd, SWEEP))
    cell = expand(sweep)[0]
    cfg = job_config(sweep, cell, "rid", "pid")
    assert run_config_hash(cfg) == cell.id
    assert Path(cfg.warmstart.cache_dir).is_absolute() and cfg.output_dir == str(sweep.folder / "cells" / cell.id)
    assert (cfg.tracking.run_id, cfg.tracking.parent_run_id) == ("rid", "pid")


def test_supersede_moves_another_runs_outputs_and_leaves_our_own(tmp_path):
    out = tmp_path / "cells" / "abc"
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    (out / "metrics.jsonl.shipped.json").write_text('{"run_id": "old"}')
    assert supersede_outputs(out, "old", None) is None and out.exists()
    moved = supersede_outputs(out, "new", None)
    assert moved is not None and not out.exists() and (moved / "metrics.jsonl").read_text() == "{}\n"
    assert supersede_outputs(out, "new", "old") is None  # nothing left to move


def test_progress_lines_name_counts_and_eta(cwd):
    rc, text = go(load_sweep(write_sweep(cwd, SWEEP.replace("[0.001, 0.9]", "[0.001]"))))
    assert rc == 0
    assert "sweep drv: 2 cells: 2 run" in text and "0 pending, 0 running, 2 done, 0 failed" in text
    assert os.path.exists(cwd / "outputs" / "drv" / "sweep_state.json")


TINY = """\
experiment: {name}
{base}grid:
  recipe: [bf16, fp8_e2e]
launcher: {{kind: local, max_parallel: 2, retries: 0}}
tracking: {{uri: "sqlite:///mlflow.db"}}
"""


@pytest.mark.slow
def test_local_end_to_end_with_the_real_core_and_the_report(cwd, capsys):
    """smoke.yaml in miniature: warm start, 2 local processes at once, MLflow, report on the parent run."""
    from launchers.cli import main

    path = write_sweep(cwd, TINY.format(name="tiny", base=tiny_core_base(steps=2)))
    assert main(["run", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warm start: done" in out and "2/2 cells finished" in out
    sweep = load_sweep(path)
    client = MlflowClient(sweep.tracking_uri())
    from fp8rl_core.tracking import CELL_TAGS, CONTRACT_METRICS, TAG_FP8_GEMM, TAG_FP8_GEMM_CHOICE, TAG_ROLE

    # one FP8 GEMM executor for every cell, from the file the first cell wrote (fp8rl_core/fp8/choice.py)
    shared = sweep.folder / "cells" / "fp8_executor.json"
    chosen = {(r.data.tags[TAG_FP8_GEMM], r.data.tags[TAG_FP8_GEMM_CHOICE]) for r in runs(sweep.tracking_uri(),
                                                                                          "tiny").values()}
    assert len(chosen) == 1 and next(iter(chosen))[1].startswith(f"sweep ({shared}: "), chosen
    for run in runs(sweep.tracking_uri(), "tiny").values():
        assert run.info.status == "FINISHED"
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "token_mult_prob_error")) == [1, 2]
        # the MLflow contract (fp8rl_core/tracking/__init__.py, docs/design.md): what the real core logs covers it
        assert set(CONTRACT_METRICS) <= set(run.data.metrics), sorted(set(CONTRACT_METRICS) - set(run.data.metrics))
        assert set(CELL_TAGS) <= set(run.data.tags) and run.data.tags[TAG_ROLE] == "cell"
        # the worst-token table of every child run is there to open from a spike (issue 15)
        table = [a.path for a in client.list_artifacts(run.info.run_id, "diagnostics")]
        assert "diagnostics/worst_tokens.jsonl" in table, table
    parent = load_state(sweep.folder).parent_run_id
    assert client.get_run(parent).info.status == "FINISHED"
    artifacts = [a.path for a in client.list_artifacts(parent, "report")]
    assert "report/report.md" in artifacts and (sweep.folder / "report" / "report.md").exists()
    assert main(["run", str(path)]) == 0 and "2 skip" in capsys.readouterr().out
    assert main(["report", str(path), "--out", str(cwd / "again")]) == 0
    printed = capsys.readouterr().out
    assert f"report: {cwd / 'again' / 'report.md'}" in printed
    assert printed.startswith("Claims (4): 1 ") and "-- claim 4:" in printed  # the verdicts, in the terminal
    assert main(["report", str(path), "--out", str(cwd / "again"), "--json"]) == 0
    verdicts = json.loads(capsys.readouterr().out)
    assert [c["number"] for c in verdicts["claims"]] == [1, 2, 3, 4], verdicts


@pytest.mark.slow
@pytest.mark.mlflow_server
def test_sweep_server_on_loopback_and_a_sweep_logging_over_http(cwd):
    """`sweep server` (127.0.0.1, a free port) -> a sweep whose cells log to it over HTTP -> Ctrl-C."""
    import signal
    import subprocess
    import sys

    from fp8rl_core.io.ports import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "launchers.cli", "server", "--port", str(port)], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith(f"MLflow server at http://127.0.0.1:{port} "), first + proc.stdout.read()
        url = f"http://127.0.0.1:{port}"
        body = SWEEP.replace("sqlite:///mlflow.db", url).replace("[0.001, 0.9]", "[0.001]")
        sweep = load_sweep(write_sweep(cwd, body))
        assert go(sweep)[0] == 0
        assert {r.info.status for r in runs(url).values()} == {"FINISHED"} and len(runs(url)) == 2
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    rc, text = go(sweep)  # the server is gone: the driver says so at once, and submits nothing
    assert rc == 3 and "does not answer" in text
