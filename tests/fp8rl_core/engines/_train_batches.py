"""A small right-padded GRPO training batch shared by the training-engine tests (native, Megatron)."""
from __future__ import annotations

import torch

from fp8rl_core.engines.base import TrainBatch

B, T, PROMPT = 4, 12, 4  # sequences, padded length, prompt tokens


def make_batch(vocab: int, seed: int = 1) -> TrainBatch:
    """B right-padded sequences: PROMPT prompt tokens, then responses of lengths 8, 6, 3, 8."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    lengths = torch.tensor([8, 6, 3, 8])
    pos = torch.arange(T)
    attn = pos[None] < PROMPT + lengths[:, None]
    resp = attn & (pos[None] >= PROMPT)
    ids = torch.where(attn, ids, torch.zeros_like(ids))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(B, T) * resp
    return TrainBatch(ids, attn, resp, advantages=adv.contiguous())
