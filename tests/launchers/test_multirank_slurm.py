"""Cells of 2 ranks on the real local SLURM cluster (scripts/slurm/cluster.sh up): one job of 2 tasks
per cell (tasks_per_node: {ranks}, cpus_per_task: 1), each task a torch.distributed rank (gloo), the real
core and a real MLflow SQLite store. A run finishes with one MLflow run and every step logged once;
`scontrol requeue` mid-run resumes it; `kill -9` of rank 1 fails the job within the collective timeout
and `sweep run` retries it from its checkpoint. Runs are held mid-flight with fp8rl_core/loop/hold.py, so
no test depends on how fast the machine is; every wait is bounded.
"""
from __future__ import annotations

import io
import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from _sweep_fakes import mlflow_db, tiny_core_base, wait_for
from mlflow import MlflowClient

from fp8rl_core.loop.hold import ENV_VAR as HOLD_VAR
from fp8rl_core.loop.hold import holders
from launchers.plan.grid import expand
from launchers.run.driver import run_sweep
from launchers.run.progress import cell_step
from launchers.run.state import load_state
from launchers.sweepfile.loading import load_sweep

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

RANKS = 2  # tasks_per_node in SWEEP: one process per rank
TIMEOUT_S = 20  # parallel.timeout_s: the collective timeout that turns a dead rank into a failed job
SWEEP = """\
experiment: {name}
{base}  parallel: {{timeout_s: {timeout}}}
grid:
  seed: [0]
launcher:
  kind: slurm
  max_parallel: 1
  retries: {retries}
  folder: {root}/{name}
  slurm: {{time: 10, nodes: 1, tasks_per_node: {ranks}, cpus_per_task: 1, mem_gb: 4, signal_delay_s: 30}}
tracking: {{uri: "sqlite:///{root}/mlflow.db"}}
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multirank_slurm")
    mlflow_db(root / "mlflow.db")
    return root


def make_sweep(root: Path, name: str, steps: int, retries: int = 0):
    path = root / f"{name}.yaml"
    base = tiny_core_base(steps, val_every=steps, cache_dir=f"{root}/ws")
    path.write_text(SWEEP.format(name=name, root=root, base=base, timeout=TIMEOUT_S, retries=retries,
                                ranks=RANKS))
    return load_sweep(path, cwd=root)


def go(sweep, **kw) -> tuple[int, str]:
    out = io.StringIO()
    rc = run_sweep(sweep, out=out, poll_s=1.0, report=False, **kw)
    return rc, out.getvalue()


def the_run(sweep):
    client = MlflowClient(sweep.tracking_uri())
    exp = client.get_experiment_by_name(sweep.experiment)
    (run,) = client.search_runs([exp.experiment_id], "tags.`fp8rl.role` = 'cell'")
    return client, run


def assert_each_step_once(sweep, steps: int) -> None:
    client, run = the_run(sweep)
    assert run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2"
    logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    assert logged == list(range(1, steps + 1)), f"loss logged at steps {logged}"


def hold_after(monkeypatch, root: Path, step: int) -> Path:
    """Runs started from here on wait after `step` until the returned file exists (sbatch exports it)."""
    release = root / f"release-{time.monotonic_ns()}"
    monkeypatch.setenv(HOLD_VAR, f"{step}:{release}")
    return release


def all_ranks_held(release: Path) -> bool:
    """Both ranks are inside the hold hook, i.e. past step 2's checkpoint (fp8rl_core/loop/hold.py)."""
    return holders(release) == RANKS


def rank_pids(job_id: str, rank: int) -> list[int]:
    """`scontrol listpids`: the processes of one task (GLOBALID) of the job's steps."""
    out = subprocess.run(["scontrol", "listpids", job_id], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    pids = []
    for line in out.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 5 and fields[4].isdigit() and int(fields[4]) == rank:
            pids.append(int(fields[0]))
    return pids


def rank0_log(sweep, job_id: str) -> str:
    return next((sweep.folder / "jobs" / job_id).glob(f"{job_id}_0_log.out")).read_text()


def test_a_two_task_job_runs_a_cell_to_finished_with_one_mlflow_run(root, slurm_cluster):
    steps = 3
    sweep = make_sweep(root, "ddp", steps)
    rc, text = go(sweep)
    assert rc == 0, text
    assert_each_step_once(sweep, steps)
    state = load_state(sweep.folder)
    (cell,) = expand(sweep)
    job = state.cells[cell.id].last().job_id
    script = next((sweep.folder / "jobs" / job).glob("*_submission.sh")).read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --nodes=1" in script
    (ws,) = [s for s in state.stages if s.name == "warmstart"]
    ws_script = next((sweep.folder / "jobs" / ws.job_id).glob("*_submission.sh")).read_text()
    assert "#SBATCH --ntasks-per-node=1" in ws_script  # a stage is one task, not one per rank
    logs = sorted((sweep.folder / "jobs" / job).glob("*_log.out"))
    assert [p.name for p in logs] == [f"{job}_0_log.out", f"{job}_1_log.out"]  # one log per task (rank)
    assert "[rank 1]" in logs[1].read_text()
    opened = [r for r in map(json.loads, (sweep.folder / "cells" / cell.id / "metrics.jsonl").read_text()
                               .splitlines()) if r.get("kind") == "status"]
    assert [r["status"] for r in opened] == ["RUNNING", "FINISHED"]  # rank 0 alone wrote the run's file


def test_scontrol_requeue_of_a_two_task_job_resumes_from_its_checkpoint(root, slurm_cluster, monkeypatch):
    steps, held = 6, 2
    sweep = make_sweep(root, "ddp_requeue", steps)
    release = hold_after(monkeypatch, root, held)  # never released: the first attempt dies held at step 2
    assert go(sweep, detach=True)[0] == 0
    (cell,) = expand(sweep)
    job = load_state(sweep.folder).cells[cell.id].last().job_id
    wait_for(lambda: all_ranks_held(release), 240, "both ranks to checkpoint step 2 and wait")
    assert cell_step(sweep.folder / "cells" / cell.id).step == held
    subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)  # SIGTERM to both tasks, a restart
    rc, text = go(sweep)  # a driver that waits for the requeued job
    assert rc == 0, text
    assert_each_step_once(sweep, steps)
    resumed = re.search(r"resuming from step_(\d+) \(SLURM_RESTART_COUNT=1\)", rank0_log(sweep, job))
    assert resumed and int(resumed.group(1)) == held


def test_kill_9_of_one_rank_fails_the_job_within_the_timeout_and_sweep_run_retries_it(root, slurm_cluster,
                                                                                     monkeypatch):
    steps, held = 4, 2
    sweep = make_sweep(root, "ddp_kill", steps, retries=1)
    release = hold_after(monkeypatch, root, held)
    assert go(sweep, detach=True)[0] == 0
    (cell,) = expand(sweep)
    job = load_state(sweep.folder).cells[cell.id].last().job_id
    wait_for(lambda: all_ranks_held(release), 240, "both ranks to checkpoint step 2 and wait")
    victims = rank_pids(job, 1)
    assert victims, "scontrol listpids shows no process of rank 1"
    for pid in victims:
        subprocess.run(["kill", "-9", str(pid)], check=False, timeout=10)
    t0 = time.monotonic()
    release.write_text("go")  # rank 0 goes on into step 3's collectives, with rank 1 dead

    def job_ended() -> bool:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                             timeout=30).stdout
        return out.strip() not in ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING")
    wait_for(job_ended, TIMEOUT_S + 90, f"job {job} to fail after rank 1 died (collective timeout {TIMEOUT_S}s)")
    ended_after = time.monotonic() - t0
    rc, text = go(sweep)  # settles the failed attempt, retries the cell: it resumes from step 2
    assert rc == 0, text
    assert_each_step_once(sweep, steps)
    rec = load_state(sweep.folder).cells[cell.id]
    assert [a.outcome for a in rec.attempts] == ["failed", "finished"]
    retry_log = rank0_log(sweep, rec.attempts[1].job_id)
    resumed = re.search(r"resuming from step_(\d+)", retry_log)
    assert resumed and int(resumed.group(1)) == held, retry_log[-2000:]  # from its checkpoint, not from zero
    first_err = next((sweep.folder / "jobs" / job).glob(f"{job}_0_log.err")).read_text()
    assert "RuntimeError" in first_err  # rank 0 raised (peer gone, or the collective timed out): no hang
    print(f"job {job} ended {ended_after:.0f}s after rank 1's kill -{signal.SIGKILL.value} (timeout {TIMEOUT_S}s)")


def test_the_ddp_smoke_sweep_runs_on_slurm(root, slurm_cluster):
    from test_multirank import assert_smoke_ddp_finished, smoke_ddp_one_cell

    sweep = smoke_ddp_one_cell(root, "launcher=slurm")
    rc, text = go(sweep)
    assert rc == 0, text
    assert_smoke_ddp_finished(sweep)
