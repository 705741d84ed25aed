"""Validation and the vLLM engine's sleep levels (issue 22; fp8rl_core/loop/run.py `_validate`).

Validation calls generate many times on one refit, and the next rollout uses the same weights again, so
the arm's engine is held awake (a level-2 sleep between the calls would discard the weights). When a second
engine (the BF16 evaluation engine) must use the GPU before that rollout, the arm's engine sleeps at level 1
(its weights kept on the host); the evaluation engine, whose next use follows a refit, at level 2. Under vLLM
the evaluation engine is the native one in BF16 for every recipe (builder.BF16Evaluator): rank 0 refits it only
after the arm's engine has slept (the two never hold the GPU together), and it decodes at most its `max_batch`
sequences at once. Faked at the engine boundary: engines that record what the loop asks of them.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from fp8rl_core.config import load_run_config
from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.engines.base import GenerationOutput
from fp8rl_core.loop.run import _validate
from fp8rl_core.model.tokenizer import char_tokenizer
from fp8rl_core.tasks import make_task


class Engine:
    """A generation engine with a sleep mode, as the loop sees VllmGenerationEngine."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.held, self.batches = name, log, 0, []
        self.generator = torch.Generator().manual_seed(0)

    @contextlib.contextmanager
    def awake(self):
        self.held += 1
        try:
            yield self
        finally:
            self.held -= 1

    def sleep(self, level: int = 2) -> None:
        self.log.append((self.name, "sleep", level))

    def generate(self, prompts, sampling) -> GenerationOutput:
        self.log.append((self.name, "generate", "held" if self.held else "free"))
        self.batches.append(len(prompts))
        ids = torch.full((len(prompts), 1), 2)
        return GenerationOutput(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros(ids.shape),
                                torch.ones(len(prompts), dtype=torch.bool))


def _ctx(mesh: Mesh, two_engines: bool, log: list, max_batch: int | None = None):
    cfg = load_run_config(None, ["task.val_size=3", "train.val_samples=2"])
    gen = Engine("arm", log)
    neutral = Engine("bf16", log) if two_engines else gen
    if max_batch is not None:
        neutral.max_batch = max_batch

    def bf16_engine():  # RunContext.bf16_engine: the refit (collective) happens here
        if two_engines:
            log.append(("bf16", "refit", None))
        return neutral

    return SimpleNamespace(cfg=cfg, gen=gen, bf16_gen=neutral if two_engines else None, bf16_engine=bf16_engine,
                           mesh=mesh, tokenizer=char_tokenizer(), task=make_task(cfg.task))


def test_one_engine_stays_awake_over_validation():
    log: list = []
    _validate(_ctx(SINGLE, False, log))
    assert log and all(e == ("arm", "generate", "held") for e in log)  # never slept: the rollout follows


def test_the_arm_sleeps_at_level_1_the_evaluation_engine_at_level_2():
    log: list = []
    _validate(_ctx(SINGLE, True, log))
    arm_end = log.index(("arm", "sleep", 1))
    assert all(e == ("arm", "generate", "held") for e in log[:arm_end]) and arm_end > 1
    rest = log[arm_end + 1:]
    # refit only once the arm's engine has given the GPU back: the two never hold it together
    assert rest[0] == ("bf16", "refit", None)
    assert rest[-1] == ("bf16", "sleep", 2) and all(e == ("bf16", "generate", "held") for e in rest[1:-1])


def test_the_native_evaluator_decodes_at_most_its_max_batch():
    """val_size 3 x val_samples 2 = 6 sampled answers: in batches of 4 (its KV bound) on the evaluator,
    one batch on the arm's vLLM engine (validation's 512), greedy on the arm only."""
    log: list = []
    ctx = _ctx(SINGLE, True, log, max_batch=4)
    out = _validate(ctx)
    assert ctx.bf16_gen.batches == [4, 2] and ctx.gen.batches == [3, 6]
    assert set(out) == {"val_accuracy", "val_accuracy_greedy", "val_accuracy_bf16_eval"}


def test_other_ranks_only_put_the_evaluation_engine_to_sleep():
    log: list = []
    assert _validate(_ctx(Mesh(world_size=2, rank=1), True, log)) is None
    assert log == [("bf16", "refit", None), ("bf16", "sleep", 2)]  # refit with rank 0 (collective), released
    log.clear()
    assert _validate(_ctx(Mesh(world_size=2, rank=1), False, log)) is None and log == []
