"""Ranks: where a process stands (torchrun / SLURM env), world size 1 costs nothing, a batch the ranks
cannot split is refused before any work, and a 2-rank torchrun run of the CLI logs every step once."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from fp8rl_core.config import load_run_config
from fp8rl_core.config.schema import ConfigError
from fp8rl_core.distributed import SINGLE, Mesh, detect_rank_env, init_distributed
from fp8rl_core.loop.builder import check_data_parallel


def test_rank_env_from_torchrun_and_slurm():
    assert detect_rank_env({}).world_size == 1
    tr = detect_rank_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (tr.rank, tr.world_size, tr.local_rank, tr.source) == (3, 4, 1, "torchrun")
    sl = detect_rank_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1"})
    assert (sl.rank, sl.world_size, sl.local_rank, sl.source) == (5, 8, 1, "slurm")
    # a single-task SLURM job (every 1-rank cell) stays a single process
    assert detect_rank_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).source == "single"


def test_world_size_1_creates_no_process_group(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    mesh = init_distributed()
    assert mesh is SINGLE and not dist.is_initialized()
    assert mesh.all_reduce_sum([2.0, 3.0]).tolist() == [2.0, 3.0] and mesh.is_rank0
    assert list(mesh.shard(6)) == [0, 1, 2, 3, 4, 5]


def test_groups_split_contiguously_and_evenly():
    assert [list(Mesh(world_size=3, rank=r).shard(6)) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="cannot be split evenly over 4 ranks"):
        Mesh(world_size=4, rank=0).shard(6)


def test_prompts_not_divisible_by_ranks_is_a_config_error(tmp_path, monkeypatch, capsys):
    cfg = load_run_config(None, ["rollout.prompts_per_step=6"])
    check_data_parallel(cfg, Mesh(world_size=3))  # 6 = 3 x 2 groups: fine
    with pytest.raises(ConfigError) as e:
        check_data_parallel(cfg, Mesh(world_size=4))
    assert e.value.key == "rollout.prompts_per_step" and "multiples of 4" in str(e.value)
    from fp8rl_core.cli import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["rollout.prompts_per_step=6", f"output_dir={tmp_path / 'x'}"]) == 2
    assert "rollout.prompts_per_step" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before any work


@pytest.mark.slow
def test_torchrun_two_ranks_runs_the_cli_and_rank0_logs_each_step_once(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    out = tmp_path / "run"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "fp8rl_core.cli", "--no-progress",
           f"output_dir={out}", f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.steps=10",
           "warmstart.batch_size=16", "train.steps=2", "train.val_every=2", "train.checkpoint_every=1",
           "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
           "task.val_size=4", "train.val_samples=1", "threads=1",
           # the sharded reference policy, micro-batches and log-prob batches in the real loop
           "loss.kl_coef=0.01", "train.micro_batch_size=1", "train.logprob_batch_size=1"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if r["kind"] == "metrics"]
    assert steps == [0, 1, 2]  # one writer: each step once
    step2 = [r["values"] for r in records if r["kind"] == "metrics" and r["step"] == 2][0]
    assert step2["kl"] >= 0 and step2["token_mult_prob_error"] >= 1.0 and "val_accuracy" in step2
    tags = [r["values"] for r in records if r["kind"] == "tags"]
    assert len(tags) == 1 and tags[0]["world_size"] == "2"
    assert tags[0]["fp8rl.bf16_compute"] in ("native", "emulated")  # with what computed this attempt
    assert [r["status"] for r in records if r["kind"] == "status"] == ["FINISHED"]
    assert proc.stdout.count('"reward_mean"') == 1  # one summary, from rank 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")) == \
        ["step_00000001", "step_00000002"]


def test_a_stuck_rank_fails_the_collective_within_the_timeout(tmp_path):
    """parallel.timeout_s reaches the process group: a peer that never joins is an error, not a hang
    (event-driven: the stuck rank is released by rank 0's flag, so no test timing depends on speed)."""
    from _ranks import run_ranks
    from _workers import stuck_peer

    seen = run_ranks(2, stuck_peer, str(tmp_path / "flag"), timeout_s=3.0)
    assert seen[1] == "released"  # rank 0 gave up first, on its own
    assert seen[0].startswith("error:") and "timed out" in seen[0].lower(), seen[0]


def test_slurm_rendezvous_port_is_per_job_and_below_the_ephemeral_range():
    from fp8rl_core.distributed.env import master_port

    ports = {master_port(str(job)) for job in range(1000, 1200)}
    assert all(20000 <= p < 32768 for p in ports) and len(ports) > 150  # spread over jobs
    assert master_port("4711_3") == master_port("4711_3")  # every task of one job agrees
