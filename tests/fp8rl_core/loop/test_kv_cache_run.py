"""The E4M3 KV cache in the run loop (fp8.kv_cache e4m3): a 2-step tiny run per scale design logs kv_scale_step
equal to the step whose weights generated (step s generates with the weights of step s - 1), the KV cache in
the compute dtype logs no KV metrics, and a refit that updates the weights but not the trainer's scales makes
generation raise."""
from __future__ import annotations

import pytest
import torch
from _tiny_runs import step_metrics, tiny_config  # beside this file (tests/fp8rl_core/loop)

from fp8rl_core.engines.kv_quant import checksum
from fp8rl_core.explain.replay import rollout_kv_scales
from fp8rl_core.loop.builder import build_context
from fp8rl_core.loop.run import run
from fp8rl_core.loop.step import sampling_params
from fp8rl_core.tracking import M_KV_SCALE_CHECKSUM, M_KV_SCALE_STEP, M_MISMATCH


def _tiny(tmp_path, name, *extra):
    return tiny_config(tmp_path, name, *extra, steps=2)


def _metrics(path):
    return step_metrics(path)


@pytest.mark.slow
@pytest.mark.parametrize("kv_scale", ["trainer", "first_forward", "per_token_head"])
def test_two_steps_log_the_step_whose_weights_generated(tmp_path, kv_scale):
    run(_tiny(tmp_path, kv_scale, "recipe=fp8_e2e", "fp8.kv_cache=e4m3", f"fp8.kv_scale={kv_scale}"), progress=False)
    m = _metrics(tmp_path / kv_scale)
    for step in (1, 2):
        assert m[step][M_KV_SCALE_STEP] == step - 1
        total = m[step][M_KV_SCALE_CHECKSUM]
        assert 0 <= total < 2**24 and total == int(total)
        assert m[step][M_MISMATCH] >= 1.0
    if kv_scale != "per_token_head":  # new weights, new scales
        assert m[1][M_KV_SCALE_CHECKSUM] != m[2][M_KV_SCALE_CHECKSUM]
    # the saved rollout keeps the per-layer scales it was generated with (explain refits its replay with them)
    saved = rollout_kv_scales(torch.load(tmp_path / kv_scale / "rollouts" / "step_00000001.pt", weights_only=True))
    if kv_scale == "per_token_head":
        assert saved is None
    else:
        assert saved.step == 0 and checksum(saved.k, saved.v) == m[1][M_KV_SCALE_CHECKSUM]


@pytest.mark.slow
def test_kv_cache_auto_logs_no_kv_metrics(tmp_path):
    run(_tiny(tmp_path, "auto", "recipe=fp8_e2e"), progress=False)
    m = _metrics(tmp_path / "auto")
    assert M_KV_SCALE_STEP not in m[1] and M_KV_SCALE_CHECKSUM not in m[2]


@pytest.mark.slow
def test_a_stale_refit_makes_generation_raise(tmp_path):
    cfg = _tiny(tmp_path, "stale", "fp8.kv_cache=e4m3")
    ctx = build_context(cfg, progress=False)
    prompts = [ctx.tokenizer.encode_prompt(ex.prompt) for ex in ctx.task.sample_train(ctx.data_rng, 2)]
    ctx.gen.generate(prompts, sampling_params(cfg))  # fresh: the initial weights' scales (step 0)
    scales = ctx.gen.kv.scales
    ctx.weights_step += 1
    ctx.gen.refit(ctx.train.weights(), step=ctx.weights_step, kv_scales=scales)  # weights updated, scales not
    with pytest.raises(RuntimeError, match="stale KV scales"):
        ctx.gen.generate(prompts, sampling_params(cfg))
    ctx.refit_generation()  # the loop's refit brings the trainer's scales for these weights
    ctx.gen.generate(prompts, sampling_params(cfg))
    assert ctx.gen.kv_scales_in_use()[0] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("kv_scale", ["trainer", "first_forward"])
def test_a_resume_is_bit_identical_with_an_e4m3_kv_cache(tmp_path, kv_scale):
    """A checkpoint keeps the trainer's KV scales (computed on the step's batch, which a resume no longer has),
    and first_forward recomputes them on the same first prefill: every metric of every step matches the
    uninterrupted run bit for bit, the KV-scale checksum included."""
    extra = ["recipe=fp8_e2e", "fp8.kv_cache=e4m3", f"fp8.kv_scale={kv_scale}", "train.steps=4",
             "train.checkpoint_every=2"]
    run(_tiny(tmp_path, "straight", *extra), progress=False)
    interrupted = _tiny(tmp_path, "interrupted", *extra)
    run(interrupted, progress=False, stop_after=2)
    run(interrupted, progress=False)
    a, b = (step_metrics(tmp_path / name, timings=False) for name in ("straight", "interrupted"))
    assert sorted(a) == [0, 1, 2, 3, 4] and a[3][M_KV_SCALE_STEP] == 2.0
    assert a == b
