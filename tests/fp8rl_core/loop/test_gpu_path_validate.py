"""Validation and the vLLM engine's sleep levels (issue 22; fp8rl_core/loop/run.py `_validate`).

Validation calls generate many times on one refit, and the next rollout uses the same weights again, so
the arm's engine is held awake (a level-2 sleep between the calls would discard the weights). When a second
engine (the BF16 evaluation engine) must use the GPU before that rollout, the arm's engine sleeps at level 1
(its weights kept on the host); the evaluation engine, whose next use follows a refit, at level 2. Under vLLM
the evaluation engine is the native one in BF16 for every recipe (engines/bf16_eval.py): every rank refits it
only after its arm's engine has slept (the two never hold the GPU together), and it decodes one validation
batch (train.val_batch_size, at most engines.vllm.max_num_seqs) at once. Every rank validates its share of the
batches (issue 31, M3). Faked at the engine boundary: engines that record what the loop asks of them, and a
mesh whose all-reduce stands in for the other ranks (their entries are 0 in this rank's vector).
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


class PeerMesh(Mesh):
    """Rank `rank` of `world_size` without a process group: the all-reduce returns this rank's own vector."""

    def _reduce(self, values, op):
        return torch.as_tensor(values, dtype=torch.float64)


def _ctx(mesh: Mesh, two_engines: bool, log: list, *overrides: str):
    cfg = load_run_config(None, ["task.val_size=3", "train.val_samples=2", *overrides])
    gen = Engine("arm", log)
    neutral = Engine("bf16", log) if two_engines else gen

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


def test_both_engines_decode_validation_batches_of_val_batch_size():
    """val_size 3 x val_samples 2 = 6 sampled answers in batches of 4 on both engines (the evaluator's KV
    bound, the same on the arm's vLLM engine so that both see the same batches and seeds), greedy on the arm
    only."""
    log: list = []
    ctx = _ctx(SINGLE, True, log, "train.val_batch_size=4")
    out = _validate(ctx)
    assert ctx.bf16_gen.batches == [4, 2] and ctx.gen.batches == [3, 4, 2]
    assert set(out) == {"val_accuracy", "val_accuracy_greedy", "val_accuracy_bf16_eval"}


def test_every_rank_validates_its_share_on_both_engines_with_the_same_sleep_levels():
    """Rank 1 of 2 (before issue 31's M3 it only took part in the evaluator's refit): its arm's engine held
    awake over its batches, then level 1; the evaluator refit after that, held over its batches, then level 2.
    Batches: arm [greedy 3, sampled 4, sampled 2] -> rank 1 runs the second; evaluator [4, 2] -> the second."""
    log: list = []
    ctx = _ctx(PeerMesh(world_size=2, rank=1), True, log, "train.val_batch_size=4")
    out = _validate(ctx)
    assert log == [("arm", "generate", "held"), ("arm", "sleep", 1), ("bf16", "refit", None),
                   ("bf16", "generate", "held"), ("bf16", "sleep", 2)]
    assert ctx.gen.batches == [4] and ctx.bf16_gen.batches == [2]
    assert set(out) == {"val_accuracy", "val_accuracy_greedy", "val_accuracy_bf16_eval"}
    log.clear()  # one engine (a BF16 arm under native generation): held awake, never slept
    one = _ctx(PeerMesh(world_size=2, rank=1), False, log, "train.val_batch_size=4")
    _validate(one)
    assert log == [("arm", "generate", "held")] and one.gen.batches == [4]


def test_a_rank_without_a_batch_still_sleeps_and_refits_with_the_others():
    """More ranks than batches (one greedy, one sampled batch at 512 rows; rank 2 of 3 has none): it generates
    nothing, but its engines go through the same sleeps and the refit (a collective) as the others."""
    log: list = []
    ctx = _ctx(PeerMesh(world_size=3, rank=2), True, log)
    _validate(ctx)
    assert log == [("arm", "sleep", 1), ("bf16", "refit", None), ("bf16", "sleep", 2)]
