"""`explain` under an E4M3 KV cache with per-layer scales (fp8.kv_scale trainer, first_forward): a saved rollout
keeps the KV scales it was generated with, and the replay refits its FP8 generation engine with them, so that
its cache holds what the rollout's did. The replay scores (prefill) rather than regenerates, so the test is
that the scales are restored and that the replay's engine scores as the rollout's engine with them does."""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.config import load_run_config
from fp8rl_core.diagnostics.tokens import save_rollout
from fp8rl_core.engines.base import TrainBatch
from fp8rl_core.engines.kv_quant import KVScales
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.explain.replay import build_variants, rollout_kv_scales
from fp8rl_core.fp8.gemm import pin_executor
from fp8rl_core.model import build_model, preset


@pytest.fixture
def emulated():
    pin_executor("emulated")
    yield
    pin_executor(None)


@pytest.mark.parametrize("kv_scale", ["trainer", "first_forward"])
def test_the_replay_holds_the_rollouts_kv_scales(tmp_path, emulated, kv_scale):
    torch.manual_seed(0)
    mc = preset("tiny")
    weights = build_model(mc).state_dict()
    cfg = load_run_config(None, ["recipe=fp8_e2e", "fp8.kv_cache=e4m3", f"fp8.kv_scale={kv_scale}"])
    L = mc.num_hidden_layers
    amax_k, amax_v = torch.linspace(1.0, 3.0, L), torch.linspace(0.5, 2.0, L)
    scales = KVScales(amax_k / 448 * 1.05, amax_v / 448 * 1.05, 7, amax_k, amax_v)
    ids = torch.randint(3, mc.vocab_size, (2, 9))
    mask = torch.ones_like(ids, dtype=torch.bool)
    batch = TrainBatch(ids, mask, mask.clone(), gen_logprobs=torch.zeros(2, 9), old_logprobs=torch.zeros(2, 9))
    path = save_rollout(tmp_path / "step_00000008.pt", batch, 8, 7, {}, {}, scales)
    saved = rollout_kv_scales(torch.load(path, weights_only=True))
    assert saved.step == 7 and torch.equal(saved.k, scales.k) and torch.equal(saved.v, scales.v)
    assert torch.equal(saved.amax_k, amax_k) and torch.equal(saved.amax_v, amax_v)

    [(_, _, gen)] = list(build_variants(["as_run"], weights, cfg, mc, saved))
    held = gen.engine.held_kv_scales()
    assert held is not None and held.step == 7 and torch.equal(held.k, scales.k) and torch.equal(held.v, scales.v)
    # the rollout's engine with these scales (what generated the batch) scores exactly as the replay's
    run = NativeGenerationEngine(mc, recipe=gen.engine.recipe, dtype=torch.bfloat16, device="cpu", seed=0)
    run.refit(weights, step=7, kv_scales=scales)
    assert torch.equal(gen.engine.logits(ids), run.logits(ids))


def test_a_rollout_without_scales_keeps_the_old_replay(tmp_path, emulated):
    """A trainer-scaled rollout saved before the scales were kept: the replay's cache stays in the dtype."""
    mc = preset("tiny")
    cfg = load_run_config(None, ["recipe=fp8_e2e", "fp8.kv_cache=e4m3"])
    ids = torch.zeros(1, 3, dtype=torch.long)
    mask = torch.ones_like(ids, dtype=torch.bool)
    path = save_rollout(tmp_path / "r.pt", TrainBatch(ids, mask, mask.clone()), 1, 0, {}, {})
    assert rollout_kv_scales(torch.load(path, weights_only=True)) is None
    [(_, _, gen)] = list(build_variants(["as_run"], build_model(mc).state_dict(), cfg, mc))
    assert gen.engine.recipe.kv_cache == "auto"
