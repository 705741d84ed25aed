"""The data-parallel split of a step: every rank draws the same P prompts and keeps its whole GRPO groups;
each rank samples with its own, reproducible stream."""
from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from fp8rl_core.config import load_run_config
from fp8rl_core.distributed import Mesh
from fp8rl_core.engines.base import GenerationOutput
from fp8rl_core.loop.builder import rank_seed
from fp8rl_core.loop.step import _rollout
from fp8rl_core.model.tokenizer import char_tokenizer
from fp8rl_core.tasks import make_task


class EchoGen:
    """A generation engine that answers each prompt with its own first 2 tokens (deterministic)."""

    def generate(self, prompts, sampling):
        ids = torch.tensor([p[:2] for p in prompts])
        ones = torch.ones_like(ids, dtype=torch.bool)
        return GenerationOutput(ids, ones, torch.zeros(ids.shape), torch.ones(len(prompts), dtype=torch.bool))


def _ctx(world: int, rank: int):
    cfg = load_run_config(None, ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=3"])
    return SimpleNamespace(cfg=cfg, tokenizer=char_tokenizer(), task=make_task(cfg.task), gen=EchoGen(),
                           data_rng=random.Random("same-on-every-rank"), mesh=Mesh(world_size=world, rank=rank))


def test_ranks_keep_whole_groups_of_the_same_global_prompts():
    prompts1, _, rewards1, _ = _rollout(_ctx(1, 0))
    assert rewards1.shape == (4, 3)
    shares = [_rollout(_ctx(2, r)) for r in (0, 1)]
    assert [s[2].shape for s in shares] == [(2, 3), (2, 3)]  # P/W groups of G samples each
    assert shares[0][0] + shares[1][0] == prompts1  # rank order = the single process's row order
    assert torch.equal(torch.cat([s[2] for s in shares]), rewards1)


def test_rank_seeds_are_distinct_and_reproducible():
    assert rank_seed(7, 0) == 7  # rank 0 samples as a single process seeded 7 would
    seeds = [rank_seed(7, r) for r in range(8)]
    assert len(set(seeds)) == 8 and seeds == [rank_seed(7, r) for r in range(8)]
    assert rank_seed(8, 1) != rank_seed(7, 1)
