"""A 2-rank run (torchrun, gloo) checkpointed mid-run resumes at 2 ranks bit-identically to an
uninterrupted one, and resumes at 1 rank (DCP reshards; the samples then differ, so only completion
and the step count are checked there)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from fp8rl_core.io import checkpoint as ck


def _is_timing(key: str) -> bool:
    return key.endswith("time_s") or key.endswith("per_s")


def _cli(world: int, out, model, steps: int) -> None:
    overrides = [f"model.path={model}", f"output_dir={out}", f"train.steps={steps}", "train.checkpoint_every=2",
                 "train.val_every=100000", "train.val_samples=0", "task.val_size=4", "threads=1",
                 "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
                 "recipe=bf16", "loss.importance_sampling=tis"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] \
        if world > 1 else [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*launch, "-m", "fp8rl_core.cli", "--no-progress", *overrides], check=True, env=env,
                   stdout=subprocess.DEVNULL, timeout=900)


def _metrics(out) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "metrics":
            assert rec["step"] not in steps or rec["step"] == 0, f"step {rec['step']} logged twice"
            steps.setdefault(rec["step"], {}).update({k: v for k, v in rec["values"].items()
                                                      if not _is_timing(k) and not k.startswith("val_")})
    return steps


@pytest.mark.slow
def test_two_rank_run_resumes_bit_identical_at_2_and_runs_on_at_1(tmp_path):
    from fp8rl_core.model import build_model, preset, save_pretrained

    torch.manual_seed(0)
    model = save_pretrained(build_model(preset("tiny", num_hidden_layers=2)), tmp_path / "model")
    _cli(2, tmp_path / "straight", model, steps=4)
    _cli(2, tmp_path / "cut", model, steps=2)  # its last step: checkpoint step_00000002
    meta = ck.read_meta(ck.latest_checkpoint(tmp_path / "cut" / "checkpoints"))
    assert meta["world_size"] == 2 and meta["step"] == 2
    shutil.copytree(tmp_path / "cut", tmp_path / "cut1")
    _cli(2, tmp_path / "cut", model, steps=4)
    straight, cut = _metrics(tmp_path / "straight"), _metrics(tmp_path / "cut")
    assert sorted(cut) == sorted(straight) == [0, 1, 2, 3, 4]
    assert {s: cut[s] for s in (3, 4)} == {s: straight[s] for s in (3, 4)}  # bit for bit, via JSON
    _cli(1, tmp_path / "cut1", model, steps=4)  # world size 1 from a world-size-2 checkpoint
    one = _metrics(tmp_path / "cut1")
    assert sorted(one) == [0, 1, 2, 3, 4] and ck.read_meta(ck.latest_checkpoint(tmp_path / "cut1" / "checkpoints"))[
        "world_size"] == 1
    assert all(torch.isfinite(torch.tensor(one[s]["loss"])) for s in (3, 4))
