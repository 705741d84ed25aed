"""Rank workers of test_validation_ranks.py (top-level, so that torch.multiprocessing can pickle them)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from fp8rl_core.config import load_run_config, recipe_of
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.loop.run import _validate
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.llama import CausalLM
from fp8rl_core.model.tokenizer import char_tokenizer
from fp8rl_core.tasks import make_task

OVERRIDES = ["recipe=fp8_gen", "task.val_size=5", "train.val_samples=3", "train.val_batch_size=4",
             "rollout.max_new_tokens=6"]


class LengthReward:
    """The arithmetic task's held-out prompts, rewarded by answer length mod 4 (in {0, 1/3, 2/3, 1}): a random
    model scores 0 on arithmetic, so this reward is what makes every sampled token count in the metrics."""

    def __init__(self, task):
        self.val_examples = task.val_examples

    def reward(self, example, text: str) -> float:
        return (len(text) % 4) / 3


def _engines(cfg) -> tuple[NativeGenerationEngine, NativeGenerationEngine]:
    """(the arm's FP8 engine, the BF16 engine) on the same random weights, on every rank."""
    model_cfg = ModelConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    torch.manual_seed(0)
    weights = CausalLM(model_cfg).state_dict()
    arm = NativeGenerationEngine(model_cfg, recipe=recipe_of(cfg), seed=11)
    bf16 = NativeGenerationEngine(model_cfg, recipe=recipe_of(cfg).in_bf16(), seed=12)
    arm.refit(weights)
    bf16.refit(weights)
    return arm, bf16


def validate(mesh, overrides: list[str]) -> dict:
    """run._validate on this rank with native engines: its metrics and the batch sizes it generated."""
    cfg = load_run_config(None, [*OVERRIDES, *overrides])
    arm, bf16 = _engines(cfg)
    calls = []
    for engine, name in ((arm, "arm"), (bf16, "bf16")):
        real = engine.generate
        engine.generate = lambda p, s, real=real, name=name: (calls.append((name, len(p), s.seed)), real(p, s))[1]
    ctx = SimpleNamespace(cfg=cfg, gen=arm, bf16_gen=bf16, bf16_engine=lambda: bf16, mesh=mesh,
                          tokenizer=char_tokenizer(), task=LengthReward(make_task(cfg.task)))
    return {"metrics": _validate(ctx), "calls": calls}
