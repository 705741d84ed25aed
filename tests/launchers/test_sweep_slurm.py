"""The sweep engine on the real local SLURM cluster, with the real run core and a real MLflow SQLite
store (scripts/slurm/cluster.sh up): arrays, idempotence, requeue + resume, a failing cell, cancel.

Tiny runs (2-12 GRPO steps of the tiny model, a 5-step warm start) keep the module at a few minutes
on 2 cores. Every wait is bounded.
"""
from __future__ import annotations

import io
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from _sweep_fakes import mlflow_db, tiny_core_base, wait_for
from mlflow import MlflowClient

from fp8rl_core.loop.hold import ENV_VAR as HOLD_VAR
from fp8rl_core.loop.hold import holders
from launchers.cli import main as sweep_main
from launchers.executors.slurm import SlurmExecutor
from launchers.executors.slurm.sbatch import slurm_submission
from launchers.plan.grid import expand
from launchers.run.driver import run_sweep
from launchers.run.progress import cell_step
from launchers.run.state import load_state
from launchers.run.status import collect
from launchers.sweepfile.loading import load_sweep

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

BASE = """\
experiment: {name}
{base}grid:
{grid}
{extra}
launcher:
  kind: slurm
  max_parallel: 2
  retries: 0
  folder: {root}/{name}
  slurm: {{time: 10, cpus_per_task: 1, mem_gb: 2, signal_delay_s: 30}}
tracking: {{uri: "sqlite:///{root}/mlflow.db"}}
"""
# An impossible shape: 4 attention heads cannot share 3 key/value heads.
BAD_MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32, "hidden_size": 256,
             "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 3,
             "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "bos_token_id": 1,
             "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}


def make_sweep(root: Path, name: str, grid: str, steps: int = 2, val_every: int = 1, extra: str = ""):
    path = root / f"{name}.yaml"
    path.write_text(BASE.format(name=name, root=root, grid=grid, extra=extra,
                                base=tiny_core_base(steps, val_every, cache_dir=f"{root}/ws")))
    return load_sweep(path, cwd=root)


def go(sweep, executor=None, **kw) -> tuple[int, str]:
    out = io.StringIO()
    rc = run_sweep(sweep, executor=executor, out=out, poll_s=1.0, report=False, **kw)
    return rc, out.getvalue()


def child_runs(sweep) -> dict[str, object]:
    client = MlflowClient(sweep.tracking_uri())
    exp = client.get_experiment_by_name(sweep.experiment)
    return {r.data.tags["cell_id"]: r for r in client.search_runs([exp.experiment_id], "tags.`fp8rl.role` = 'cell'")}


def in_squeue(job_ids: list[str]) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout
    return [j for j in out.split() if j in job_ids or j.split("_")[0] in {i.split("_")[0] for i in job_ids}]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("slurm_sweeps")
    mlflow_db(root / "mlflow.db")
    bad = root / "bad_model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(BAD_MODEL))
    return root


@pytest.fixture(scope="module")
def base(root, slurm_cluster):
    """bf16 and fp8_e2e on the warm start, and bf16 on a model of impossible shape: 3 cells."""
    grid = f"  recipe: [bf16, fp8_e2e]\n  model.path: [null, {root}/bad_model]"
    sweep = make_sweep(root, "base", grid, extra=f"exclude:\n  - {{recipe: fp8_e2e, model.path: {root}/bad_model}}")
    t0 = time.time()
    rc, text = go(sweep)
    print(f"base sweep: {time.time() - t0:.0f}s\n{text}")
    return sweep, rc, text


def test_a_sweep_runs_as_one_array_after_its_warm_start(base):
    sweep, rc, text = base
    cells = expand(sweep)
    runs = child_runs(sweep)
    bad = {c.id for c in cells if c.config.model.path}
    assert {c: runs[c].info.status for c in runs} == {c.id: "FAILED" if c.id in bad else "FINISHED" for c in cells}
    assert rc == 1, text
    state = load_state(sweep.folder)
    (ws,) = [s for s in state.stages if s.name == "warmstart"]
    arrays = {a.job_id.split("_")[0] for rec in state.cells.values() for a in rec.attempts}
    assert len(arrays) == 1, f"cells were not submitted as one array: {arrays}"
    sbatch = next(Path(sweep.folder, "jobs").rglob(f"{arrays.pop()}_*submission.sh"), None) or next(
        p for p in Path(sweep.folder, "jobs").rglob("*submission.sh") if "--array" in p.read_text())
    script = sbatch.read_text()
    assert "#SBATCH --array=0-2%2" in script and f"#SBATCH --dependency=afterok:{ws.job_id}" in script
    good = runs[next(c.id for c in cells if c.id not in bad)]
    history = MlflowClient(sweep.tracking_uri()).get_metric_history(good.info.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2]
    assert good.data.tags["slurm_job_id"].split("_")[0] in {a.job_id.split("_")[0] for r in state.cells.values()
                                                            for a in r.attempts}


def test_a_failing_cell_fails_alone_with_its_error_in_status(base, capsys):
    sweep, _, _ = base
    _, rows, _ = collect(sweep)
    failed = [r for r in rows if r["state"] not in ("finished",)]
    assert len(failed) == 1 and failed[0]["cell"].config.model.path
    assert "num_attention_heads (4) must be a multiple of num_key_value_heads (3)" in failed[0]["error"]
    assert sweep_main(["status", sweep.name]) == 0
    assert "must be a multiple of num_key_value_heads (3)" in capsys.readouterr().out


def test_running_the_sweep_again_submits_nothing(base):
    sweep, _, _ = base
    ex = SlurmExecutor(slurm_submission(sweep))
    rc, text = go(sweep, ex)
    assert ex.sbatch_calls == 0 and "1 exhausted, 2 skip" in text and rc == 1


def test_a_deleted_run_reruns_only_its_cell(base):
    sweep, _, _ = base
    runs = child_runs(sweep)
    victim = next(c for c in expand(sweep) if not c.config.model.path and c.config.recipe == "bf16")
    MlflowClient(sweep.tracking_uri()).delete_run(runs[victim.id].info.run_id)
    ex = SlurmExecutor(slurm_submission(sweep))
    rc, text = go(sweep, ex)
    assert ex.sbatch_calls == 1, text
    after = child_runs(sweep)
    assert after[victim.id].info.status == "FINISHED" and after[victim.id].info.run_id != runs[victim.id].info.run_id
    assert {c: r.info.run_id for c, r in after.items() if c != victim.id} == \
        {c: r.info.run_id for c, r in runs.items() if c != victim.id}
    state = load_state(sweep.folder)
    assert [len(state.cells[c.id].attempts) for c in expand(sweep)].count(2) == 1


def hold_cells_after(monkeypatch, root: Path, step: int) -> Path:
    """Every run started from here on stops after `step` (logged and checkpointed) until the returned
    file exists (fp8rl_core/loop/hold.py): the test acts on cells in flight however fast the machine is.
    A run resumed from that step's checkpoint starts after it, so it never waits."""
    release = root / f"release-{time.monotonic_ns()}"
    monkeypatch.setenv(HOLD_VAR, f"{step}:{release}")  # sbatch exports it to the jobs
    return release


def test_requeued_cells_resume_from_their_checkpoints_without_losing_or_doubling_steps(root, slurm_cluster,
                                                                                      monkeypatch):
    import submitit

    steps, held = 40, 2  # each cell is held after step 2 until the requeue has reached it
    sweep = make_sweep(root, "requeue", "  seed: [0, 1]", steps=steps, val_every=10)
    release = hold_cells_after(monkeypatch, root, held)
    rc, _ = go(sweep, detach=True)
    assert rc == 0
    cells = expand(sweep)
    state = load_state(sweep.folder)
    jobs = {c.id: state.cells[c.id].last().job_id for c in cells}
    dirs = {c.id: sweep.folder / "cells" / c.id for c in cells}
    # both processes inside the hold, i.e. past step 2's checkpoint (its metric line comes before it)
    wait_for(lambda: holders(release) == 2, 240, "both cells to checkpoint step 2 and wait")
    a, b = cells
    assert [cell_step(d).step for d in dirs.values()] == [held, held], "a held cell went on"
    subprocess.run(["scontrol", "requeue", jobs[a.id]], check=True, timeout=30)  # SIGTERM, then a restart
    submitit.SlurmJob(sweep.folder / "jobs" / "%j", jobs[b.id])._interrupt()  # preemption: USR2 -> checkpoint()
    # never released: the first attempts die held at step 2; the restarted ones resume after it and go on
    rc, text = go(sweep)  # a driver that waits for the requeued jobs
    assert rc == 0, text
    client = MlflowClient(sweep.tracking_uri())
    for cell in cells:
        run = child_runs(sweep)[cell.id]
        assert run.info.status == "FINISHED"
        for key, expected in (("loss", list(range(1, steps + 1))), ("val_accuracy", [0, 10, 20, 30, 40])):
            logged = [m.step for m in client.get_metric_history(run.info.run_id, key)]
            assert sorted(logged) == expected, f"{cell.id} {key}: steps {sorted(logged)}"
        log = Path(state.cells[cell.id].last().stderr).with_suffix(".out").read_text()
        resumed = re.search(r"resuming from step_(\d+) \(SLURM_RESTART_COUNT=1\)", log)
        assert resumed and int(resumed.group(1)) == held, log[-2000:]  # resumed mid-run, not from zero
        opened = [r for r in map(json.loads, (dirs[cell.id] / "metrics.jsonl").read_text().splitlines())
                  if r.get("kind") == "status" and r["status"] == "RUNNING"]
        assert len(opened) == 2  # the same MLflow run, opened by both attempts


def test_cancel_leaves_nothing_in_squeue(root, slurm_cluster, capsys, monkeypatch):
    sweep = make_sweep(root, "cancel", "  seed: [0, 1, 2]", steps=200, val_every=100)
    release = hold_cells_after(monkeypatch, root, 1)  # never released: the cells are cancelled while held
    assert go(sweep, detach=True)[0] == 0
    state = load_state(sweep.folder)
    ids = [rec.last().job_id for rec in state.cells.values()] + [s.job_id for s in state.stages]
    wait_for(lambda: holders(release) >= 1, 180, "a cell to run and wait after step 1")
    assert in_squeue(ids)
    assert sweep_main(["cancel", sweep.name]) == 0
    assert "nothing left in the queue" in capsys.readouterr().out
    assert in_squeue(ids) == []
    assert {r.info.status for r in child_runs(sweep).values()} == {"KILLED"}
    assert all(rec.last().outcome == "cancelled" for rec in load_state(sweep.folder).cells.values())
