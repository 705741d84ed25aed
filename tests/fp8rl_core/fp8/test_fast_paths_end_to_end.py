"""The fused quantizer and the weight cache change no bit of either engine's fp8 results.

Reference run: FP8RL_FUSED=0 (pure-torch kernels) and FP8RL_WEIGHT_CACHE=0 (Q(W) at every forward),
the code paths before issue 16. Both runs start from the same weights and draw the same samples.
"""
from __future__ import annotations

import torch

from fp8rl_core.config import OptimSpec
from fp8rl_core.config.recipe import RECIPES
from fp8rl_core.engines.base import SamplingParams, TrainBatch
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.engines.native_train import NativeTrainingEngine
from fp8rl_core.model import ModelConfig, build_model

CFG = ModelConfig(vocab_size=32, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)


def batch() -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, CFG.vocab_size, (4, 12), generator=g)
    attn = torch.arange(12)[None] < torch.tensor([12, 10, 7, 12])[:, None]
    resp = attn & (torch.arange(12)[None] >= 4)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * resp
    return TrainBatch(ids * attn, attn, resp, advantages=adv)


def run_both_engines() -> list[torch.Tensor]:
    """Generation (fp8) from the initial weights, then two fp8_e2e train steps with log-prob passes."""
    torch.manual_seed(0)
    model = build_model(CFG)
    gen = NativeGenerationEngine(CFG, recipe=RECIPES["fp8_e2e"], seed=0)
    gen.refit(model.state_dict())
    out = gen.generate([[1, 5, 6, 7], [1, 9, 3], [1, 5, 6, 7]], SamplingParams(max_new_tokens=5))
    train = NativeTrainingEngine(model, recipe=RECIPES["fp8_e2e"], optim=OptimSpec(lr=1e-2))
    b = batch()
    seen = [out.response_ids, out.logprobs]
    for _ in range(2):
        seen.append(train.logprobs(b))
        seen.append(torch.tensor(train.train_step(b).metrics["loss"]))
    seen.append(train.logprobs(b))
    gen.refit(train.weights())
    seen.append(gen.logits(torch.tensor([[1, 5, 6, 7, 8]])))
    return seen + [p.detach().clone() for p in model.parameters()]


def test_fast_paths_give_the_reference_bits(monkeypatch):
    fast = run_both_engines()
    monkeypatch.setenv("FP8RL_FUSED", "0")
    monkeypatch.setenv("FP8RL_WEIGHT_CACHE", "0")
    reference = run_both_engines()
    assert len(fast) == len(reference)
    for i, (a, b) in enumerate(zip(fast, reference)):
        assert torch.equal(a, b), f"tensor {i} differs"
