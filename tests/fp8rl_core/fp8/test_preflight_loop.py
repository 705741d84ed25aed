"""The FP8 GEMM preflight where a cell starts (fp8rl_core/loop/builder.py gemm_preflight, run.py): a real tiny
run on the CPU, whose executor is wrong for one GEMM shape, refuses to start and names the shape; a good one
logs the result; the shapes follow the recipe's FP8 sides."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from fp8rl_core.config import load_run_config
from fp8rl_core.fp8 import gemm, preflight
from fp8rl_core.loop import builder
from fp8rl_core.loop import run as run_mod
from fp8rl_core.model.config import PRESETS


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    return tmp_path_factory.mktemp("ws")


def tiny(tmp_path, warm, *extra):
    return load_run_config(None, [
        f"output_dir={tmp_path / 'run'}", f"warmstart.cache_dir={warm}", "warmstart.steps=4",
        "warmstart.batch_size=8", "train.steps=1", "train.val_every=1", "train.checkpoint_every=1",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=3",
        "task.val_size=2", "threads=1", *extra])


def records(path, kind):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()
            if json.loads(line).get("kind") == kind]


def test_a_wrong_executor_for_one_shape_refuses_the_cell(tmp_path, warm, monkeypatch):
    real = gemm.scaled_mm

    def wrong_for_gate_up(a, b, **kw):  # e.g. a scale layout bug at one (K, N): the [gate|up] weight's
        c = real(a, b, **kw)
        return c * 2 if (a.q.shape[1], b.q.shape[0]) == (256, 768) and b.block == (128, 128) else c

    monkeypatch.setattr(gemm, "scaled_mm", wrong_for_gate_up)
    started = []
    monkeypatch.setattr(builder, "build_engines", lambda *a, **k: started.append("engines"))
    monkeypatch.setattr(run_mod, "grpo_step", lambda ctx: started.append("step"))
    with pytest.raises(run_mod.RunFailed) as info:
        run_mod.run(tiny(tmp_path, warm, "recipe=fp8_e2e"), progress=False)
    text = str(info.value)
    assert "FP8 GEMM preflight failed on cpu" in text and "2^-9 * C_abs" in text
    assert "gate_proj/up_proj fprop M=5 K=256 N=768 blocks A(1, 128) x B(128, 128)" in text
    assert isinstance(info.value.__cause__, preflight.PreflightError)
    assert started == []  # no engine was built, no FP8 step ran
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not records(tmp_path / "run", "metrics")


def test_a_cell_logs_its_preflight(tmp_path, warm):
    run_mod.run(tiny(tmp_path, warm, "recipe=fp8_e2e"), progress=False)
    out = tmp_path / "run"
    step0 = {k: v for r in records(out, "metrics") if r["step"] == 0 for k, v in r["values"].items()}
    shapes = len(builder.preflight_shapes(tiny(tmp_path, warm, "recipe=fp8_e2e"), PRESETS["tiny"], device="cpu"))
    assert step0["fp8_preflight_shapes"] == shapes == 28 and 0 < step0["fp8_preflight_worst_ratio"] < 1
    tags = {k: v for r in records(out, "tags") for k, v in r["values"].items()}
    assert tags[preflight.TAG] == "passed" and tags[f"{preflight.TAG}.executor"] == gemm.select_executor("cpu")


@dataclass(frozen=True)
class FakeMesh:
    """Rank 0 of 4 where rank `failing` failed its preflight (the all-reduce's answer)."""

    failing: int
    world_size: int = 4
    rank: int = 0

    def all_reduce_max(self, values):
        return torch.tensor([max(float(values[0]), self.failing + 1.0)], dtype=torch.float64)


def test_every_rank_fails_when_one_does(tmp_path, warm):
    cfg = tiny(tmp_path, warm, "recipe=fp8_e2e", "rollout.prompts_per_step=4")
    with pytest.raises(preflight.PreflightError, match="failed on rank 2 .*28 shapes passed on cpu"):
        builder.gemm_preflight(cfg, PRESETS["tiny"], "cpu", FakeMesh(failing=2))
    assert builder.gemm_preflight(cfg, PRESETS["tiny"], "cpu", FakeMesh(failing=-1))[preflight.TAG] == "passed"


def test_skipping_is_explicit_and_recorded(tmp_path, warm, monkeypatch):
    monkeypatch.setenv(builder.PREFLIGHT_ENV, "0")
    cfg = tiny(tmp_path, warm, "recipe=fp8_e2e")
    assert builder.gemm_preflight(cfg, PRESETS["tiny"], "cpu") == {preflight.TAG: "skipped"}
    assert preflight.metrics_from_params({preflight.TAG: "skipped"}) == {}


def test_the_shapes_follow_the_recipe_and_the_engines(tmp_path, warm):
    model = PRESETS["tiny"]
    shapes = lambda *extra, device="cpu": builder.preflight_shapes(  # noqa: E731
        tiny(tmp_path, warm, *extra), model, device=device)
    assert shapes("recipe=bf16") == []
    gen = shapes("recipe=fp8_gen")
    assert {s.pass_name for s in gen} == {"fprop"} and any("fused" in s.layer for s in gen)
    assert {s.m for s in gen} == set(preflight.CPU_MS)
    assert {s.pass_name for s in shapes("recipe=fp8_e2e")} == {"fprop", "dgrad", "wgrad"}
    assert shapes("recipe=fp8_e2e", "fp8.format=mxfp8") == []  # other formats: lowp.py's emulated GEMMs
    assert "lm_head" in {s.layer for s in shapes("recipe=fp8_e2e", "fp8.lm_head=fp8")}
    # on CUDA: the rank's decoded rows, a micro-batch's tokens (rows x (64 prompt + new tokens)) and, as the
    # native engine generates in FP8 here, its prefill of the rank's 2 prompts at 64 tokens (issue 31, M9)
    cuda = shapes("recipe=fp8_e2e", "train.micro_batch_size=2", device="cuda")
    assert {s.m for s in cuda} == {4, 2 * (64 + 3), 2 * 64}
    vllm_gen = shapes("recipe=fp8_e2e", "train.micro_batch_size=2", "engines.generation=vllm", device="cuda")
    assert {s.m for s in vllm_gen} == {4, 2 * (64 + 3)}  # vLLM's prefill runs vLLM's kernels, not ours
