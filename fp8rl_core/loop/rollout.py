"""Turn prompts + generation output into a right-padded training batch.

Layout of one row (T = max over rows of prompt_len + response_len):
    [p_0 .. p_{L-1} | r_0 .. r_{k} (up to and incl. EOS) | pad ...]
`response_mask[t]` is True on the response tokens that count; `gen_logprobs[t]` holds the generation
engine's log-prob of `input_ids[t]` at those positions. Tokens sampled after EOS never enter the batch
(they made the mismatch metric noisy, docs/design.md).
"""
from __future__ import annotations

import torch

from fp8rl_core.engines.base import GenerationOutput, TrainBatch


def build_train_batch(prompts: list[list[int]], out: GenerationOutput, pad_id: int) -> TrainBatch:
    """prompts: B token lists; out: the engine's output for them -> TrainBatch (advantages unset)."""
    lengths = out.response_mask.sum(dim=1).tolist()  # valid response tokens per row
    total = [len(p) + int(n) for p, n in zip(prompts, lengths)]
    B, T = len(prompts), max(total)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention = torch.zeros((B, T), dtype=torch.bool)
    response = torch.zeros((B, T), dtype=torch.bool)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        L, n = len(p), int(n)
        input_ids[i, :L] = torch.tensor(p, dtype=torch.long)
        input_ids[i, L:L + n] = out.response_ids[i, :n]
        attention[i, :L + n] = True
        response[i, L:L + n] = True
    return TrainBatch(input_ids=input_ids, attention_mask=attention, response_mask=response,
                      gen_logprobs=place_response_values(out.logprobs, response))


def place_response_values(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-response-token values Float[B, R] (left-aligned, as a GenerationOutput holds them) -> Float32[B, T]
    at the batch's response positions (response_mask Bool[B, T]; a row's k valid tokens take its first k
    values), 0 elsewhere."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    mask = response_mask.cpu()
    counts = mask.sum(dim=1)
    taken = torch.arange(values.shape[1])[None, :] < counts[:, None]  # [B, R]: the values that count
    out[mask] = values.detach().cpu().float()[taken]
    return out


def broadcast_advantages(adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """adv: [B] per-sequence advantage -> [B, T] on response tokens, 0 elsewhere."""
    return adv.float()[:, None] * response_mask.float()


def split_rows(batch_size: int, parts: int, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Row indices of `parts` near-equal minibatches (one optimizer micro-step each), shuffled."""
    parts = max(1, min(parts, batch_size))
    order = torch.randperm(batch_size, generator=generator)
    return [chunk for chunk in torch.tensor_split(order, parts) if len(chunk)]
