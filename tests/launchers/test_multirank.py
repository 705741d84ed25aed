"""Cells on several ranks (launcher.ranks_per_cell locally, nodes x tasks_per_node on SLURM): the keys
and their checks, slot accounting, rank-0-only MLflow marking, the world-size columns, the memory plan
in `sweep plan`/`sweep run`, and one real 2-rank cell through the local executor (real torch.distributed
gloo processes, the real core, a real MLflow SQLite store). The SLURM counterpart lives in
tests/launchers/test_multirank_slurm.py.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from _sweep_fakes import tiny_core_base, write_sweep

from fp8rl_core.config.schema import ConfigError
from launchers import cli
from launchers.executors import Task
from launchers.executors.local import LocalExecutor
from launchers.plan.grid import expand
from launchers.run import jobs
from launchers.run.driver import run_sweep
from launchers.sweepfile.loading import load_sweep, load_sweep_text

REPO = Path(__file__).resolve().parents[2]
GRID = "experiment: t\ngrid:\n  seed: [0, 1]\n"
# Llama-3.1-8B's config.json (the shapes are all the memory plan reads)
LLAMA8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
           "bos_token_id": 128000, "eos_token_id": 128009, "tie_word_embeddings": False}


def sweep_text(launcher: str) -> str:
    return GRID + f"launcher: {launcher}\n"


# ---- keys ---------------------------------------------------------------------------------------------
def test_world_size_is_ranks_per_cell_locally_and_nodes_times_tasks_on_slurm():
    local = load_sweep_text(sweep_text("{kind: local, max_parallel: 4, ranks_per_cell: 2}"))
    assert local.launcher.world_size == 2
    slurm = load_sweep_text(sweep_text("{kind: slurm, slurm: {nodes: 2, tasks_per_node: 4}}"))
    assert slurm.launcher.world_size == 8
    assert load_sweep_text(sweep_text("{kind: debug}")).launcher.world_size == 1


@pytest.mark.parametrize("launcher, problem, valid", [
    ("{kind: debug, ranks_per_cell: 2}", "runs cells in-process", "1, or kind local/slurm"),
    ("{kind: local, max_parallel: 1, ranks_per_cell: 2}", "takes 2 slots", "max_parallel >= 2"),
    ("{kind: slurm, ranks_per_cell: 4, slurm: {tasks_per_node: 2}}", "slurm.tasks_per_node = 2 tasks", "1 or 2"),
    ("{kind: local, ranks_per_cell: 0}", "must be >= 1", None),
    ("{kind: slurm, slurm: {gpu_mem_gb: 0}}", "must be > 0", None),
])
def test_bad_rank_layouts_name_the_file_the_key_and_the_choices(launcher, problem, valid):
    with pytest.raises(ConfigError) as e:
        load_sweep_text(sweep_text(launcher), "t.yaml")
    text = str(e.value)
    assert text.startswith("t.yaml:4: launcher.") and problem in text, text
    assert valid is None or f"valid: {valid}" in text, text


def test_slurm_override_of_the_ddp_smoke_file_runs_each_cell_as_one_job_of_two_tasks():
    from launchers.executors.slurm.sbatch import render_sbatch, slurm_submission

    sweep = load_sweep(REPO / "sweeps" / "smoke_ddp.yaml", ["launcher=slurm"])
    assert sweep.launcher.world_size == 2 and sweep.launcher.ranks_per_cell == 2
    assert "#SBATCH --ntasks-per-node=2" in render_sbatch(slurm_submission(sweep), 12)
    assert all(c.config.rollout.prompts_per_step % 2 == 0 for c in expand(sweep))


# ---- executors ------------------------------------------------------------------------------------------
def test_a_two_rank_local_cell_takes_two_slots(tmp_path):
    ex = LocalExecutor(tmp_path, max_parallel=4, ranks_per_cell=2)
    assert [ex.slots(n) for n in range(4)] == [2, 1, 0, 0]
    assert LocalExecutor(tmp_path, max_parallel=3, ranks_per_cell=2).slots(0) == 1
    assert LocalExecutor(tmp_path, max_parallel=3).slots(1) == 2


def test_slurm_stages_run_as_one_task_and_cells_as_nodes_times_tasks(tmp_path):
    from submitit.slurm.test_slurm import mocked_slurm

    from launchers.executors.slurm import SlurmExecutor
    from launchers.executors.slurm.sbatch import SlurmSubmission

    sub = SlurmSubmission(tmp_path / "jobs" / "%j", "python", {"job_name": "t", "time": 5, "nodes": 2,
                                                              "ntasks_per_node": 4})
    with mocked_slurm():
        ex = SlurmExecutor(sub)
        (stage,) = ex.submit([Task("warmstart", print, ())])
        cells = ex.submit([Task(f"c{i}", print, (), ranks=8) for i in range(2)])
        with pytest.raises(ValueError, match="one shape"):
            ex.submit([Task("a", print, (), ranks=8), Task("b", print, ())])
    scripts = {p.parent.name: p.read_text() for p in (tmp_path / "jobs").rglob("*_submission.sh")}
    assert "#SBATCH --ntasks-per-node=1" in scripts[stage.job_id] and "#SBATCH --nodes=1" in scripts[stage.job_id]
    cell_script = next(t for name, t in scripts.items() if name != stage.job_id)
    assert "#SBATCH --ntasks-per-node=4" in cell_script and "#SBATCH --nodes=2" in cell_script
    assert len(cells) == 2


# ---- inside the job: every rank runs, rank 0 alone marks ------------------------------------------------
def test_local_ranks_come_from_submitits_task_ids():
    env = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_GLOBALID": "1",
           "SUBMITIT_LOCAL_LOCALID": "1", "MASTER_PORT": "12345"}
    jobs.export_local_ranks(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_ADDR"]) == ("1", "2", "1", "127.0.0.1")
    single = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_GLOBALID": "0"}
    jobs.export_local_ranks(single)
    assert "RANK" not in single
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_PROCID": "1"}
    jobs.export_local_ranks(slurm)
    assert "RANK" not in slurm  # SLURM ranks: fp8rl_core.distributed.env reads SLURM_PROCID itself


def _failing(cfg):
    raise RuntimeError("a peer died")


@pytest.mark.parametrize("env, marked", [
    ({"RANK": "1", "WORLD_SIZE": "2"}, False),
    ({"RANK": "0", "WORLD_SIZE": "2"}, True),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}, False),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, True),
    ({}, True),
])
def test_only_global_rank_zero_marks_the_mlflow_run(tmp_path, monkeypatch, env, marked):
    from fp8rl_core.config import RunConfig, TrackingSpec
    from fp8rl_core.config.schema import to_dict
    from fp8rl_core.tracking import runs

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    calls = []
    monkeypatch.setattr(runs, "end_run", lambda uri, run_id, status, **kw: calls.append((run_id, status)))
    cfg = RunConfig(output_dir=str(tmp_path), tracking=TrackingSpec(uri="sqlite:///x.db", run_id="r1"))
    with pytest.raises(RuntimeError, match="a peer died"):
        jobs.CellJob(_failing)(to_dict(cfg))
    assert calls == ([("r1", "FAILED")] if marked else [])


# ---- plan and status: world size, memory ----------------------------------------------------------------
def llama_sweep(tmp_path: Path, tasks_per_node: int) -> list[str]:
    model = tmp_path / "llama8b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA8B))
    return [str(REPO / "sweeps" / "fp8_ablation_llama8b.yaml"), f"base.model.path={model}",
            f"launcher.slurm.tasks_per_node={tasks_per_node}", f"launcher.folder={tmp_path / 'out'}",
            f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}"]


def test_llama8b_on_one_80gb_gpu_is_refused_naming_the_knobs_and_nothing_is_created(tmp_path, capsys):
    args = llama_sweep(tmp_path, 1)
    args_small = [*args, "base.train.micro_batch_size=0", "base.train.logprob_batch_size=0",
                  "base.parallel.activation_checkpointing=false"]
    for argv in (args, args_small):
        assert cli.main(["plan", *argv]) == 2
        out, err = capsys.readouterr()
        assert " REFUSED " in out and "world_size" in out
        assert "launcher.slurm.gpu_mem_gb: cell " in err and "has 79.6 GiB" in err, err
        for knob in ("more ranks", "train.micro_batch_size=1", "parallel.activation_checkpointing=true",
                     "parallel.cpu_offload=true"):
            assert knob in err, err
        assert cli.main(["run", *argv]) == 2
        assert "nothing was submitted" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "mlflow.db").exists()


def test_llama8b_sharded_over_8_gpus_of_80gb_is_accepted(tmp_path, capsys):
    assert cli.main(["plan", *llama_sweep(tmp_path, 8)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in
            {c.id for c in expand(load_sweep(llama_sweep(tmp_path, 8)[0], llama_sweep(tmp_path, 8)[1:]))}]
    assert len(rows) == 12 and all(r[4] == "8" and r[5].endswith("/80") for r in rows), out
    assert "REFUSED" not in out


def test_a_cpu_cell_is_checked_against_mem_gb_per_task(tmp_path, cwd):
    path = write_sweep(cwd, "experiment: mem\n" + tiny_core_base(2) + """\
grid:
  seed: [0]
launcher: {kind: slurm, slurm: {tasks_per_node: 2, mem_gb: 0.5}}
""")
    # 0.25 GiB per task, less the process's own 0.5 GiB: nothing is left for tensors
    with pytest.raises(ConfigError, match=r"launcher.slurm.mem_gb: cell .* has 0.0 GiB"):
        run_sweep(load_sweep(path))
    assert not (cwd / "outputs").exists()


def test_status_shows_each_cells_world_size(cwd):
    from launchers.run.status import sweep_status

    path = write_sweep(cwd, sweep_text("{kind: local, max_parallel: 2, ranks_per_cell: 2}"))
    out = io.StringIO()
    assert sweep_status(load_sweep(path), out=out) == 0
    lines = out.getvalue().splitlines()
    header = next(line for line in lines if line.startswith("id "))
    assert header.split()[:3] == ["id", "seed", "world_size"]
    assert all(line.split()[2] == "2" for line in lines[lines.index(header) + 1:] if line.strip())


# ---- a real 2-rank cell through the local executor --------------------------------------------------
@pytest.mark.slow
def test_a_local_cell_on_two_ranks_runs_to_finished_with_one_mlflow_run(cwd):
    from mlflow import MlflowClient

    steps = 3
    path = write_sweep(cwd, "experiment: ddp\n" + tiny_core_base(steps, cache_dir=str(cwd / "ws")) + """\
  parallel: {timeout_s: 60}
grid:
  seed: [0]
launcher: {kind: local, max_parallel: 2, ranks_per_cell: 2, retries: 0}
tracking: {uri: "sqlite:///mlflow.db"}
""")
    sweep = load_sweep(path)
    out = io.StringIO()
    assert run_sweep(sweep, out=out, poll_s=0.5, report=False) == 0, out.getvalue()
    client = MlflowClient(sweep.tracking_uri())
    exp = client.get_experiment_by_name("ddp")
    (run,) = client.search_runs([exp.experiment_id], "tags.`fp8rl.role` = 'cell'")
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, steps + 1))
    logs = sorted((sweep.folder / "jobs").glob("*_log.out"))
    assert len(logs) == 2  # one controller, two tasks: rank 0 and rank 1
    assert "[rank 1]" in logs[1].read_text() and "[rank 1]" not in logs[0].read_text()
    assert os.environ.get("MASTER_PORT") is None  # the driver's own environment is left as it was


def test_prompts_that_cannot_be_split_over_the_ranks_are_refused_before_anything_runs(cwd):
    path = write_sweep(cwd, "experiment: split\n" + tiny_core_base(2).replace("prompts_per_step: 2",
                                                                              "prompts_per_step: 3") + """\
grid:
  seed: [0]
launcher: {kind: local, max_parallel: 2, ranks_per_cell: 2}
""")
    with pytest.raises(ConfigError) as e:
        run_sweep(load_sweep(path))
    assert "rollout.prompts_per_step" in str(e.value) and "over 2 ranks" in str(e.value)
    assert "valid: a multiple of 2" in str(e.value) and str(e.value).startswith(f"{path}:")
    assert not (cwd / "outputs").exists()


def pid_then_sleep(folder: str) -> None:
    Path(folder, f"rank{os.environ['SUBMITIT_LOCAL_GLOBALID']}.pid").write_text(str(os.getpid()))
    import time

    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_cancel_stops_every_process_of_a_two_rank_local_cell(tmp_path):
    import sys
    import time

    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test modules are not importable in jobs
    ex = LocalExecutor(tmp_path, max_parallel=2, ranks_per_cell=2)
    (h,) = ex.submit([Task("c", pid_then_sleep, (str(tmp_path),), ranks=2)])
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.pid"))) < 2:
        assert time.monotonic() < deadline, "the two ranks did not start"
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("rank*.pid"))]
    assert all(_alive(p) for p in pids) and ex.poll([h])[h.job_id] == "running"
    ex.cancel([h])
    assert ex.wait([h], 30) and ex.poll([h])[h.job_id] == "cancelled"
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"ranks still alive after cancel: {pids}"
        time.sleep(0.2)


def smoke_ddp_one_cell(root: Path, *more: str):
    """sweeps/smoke_ddp.yaml cut to one cell (fp8_e2e, token IS, seed 0), writing under `root`."""
    return load_sweep(REPO / "sweeps" / "smoke_ddp.yaml", [
        "grid.recipe=[fp8_e2e]", "grid.loss.importance_sampling=[token]", "seeds=1",
        f"launcher.folder={root}/smoke_ddp", f"tracking.uri=sqlite:///{root}/mlflow.db",
        f"base.warmstart.cache_dir={root}/ws", *more], cwd=root)


def assert_smoke_ddp_finished(sweep) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(sweep.tracking_uri())
    exp = client.get_experiment_by_name("smoke_ddp")
    (run,) = client.search_runs([exp.experiment_id], "tags.`fp8rl.role` = 'cell'")
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "token_mult_prob_error")) == [1, 2, 3]


@pytest.mark.slow
def test_the_ddp_smoke_sweep_runs_locally(cwd):
    sweep = smoke_ddp_one_cell(cwd)
    out = io.StringIO()
    assert run_sweep(sweep, out=out, poll_s=0.5, report=False) == 0, out.getvalue()
    assert_smoke_ddp_finished(sweep)
