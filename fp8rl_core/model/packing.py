"""Padding-free batches (`train.padding_free`): the real tokens of a padded batch, as one row.

A padded batch [B, T] spends the token-wise work (embeddings, norms, every linear including the FP8 ones
and the LM head, the MLP) on its padding as well. `pack(attention_mask)` lists the N real tokens in
row-major order; the model (`CausalLM(ids [1, N], packed=p)`) runs every token-wise op on [1, N, hidden]
and attention per sequence: layers.Attention scatters the packed q, k, v into a compact grid [B, L]
(L = the longest real length, sequence b in row b from column 0), runs the same causal SDPA as the
padded path, and gathers the N real outputs back. RoPE positions count real tokens (0 at each
sequence's first token): what `llama.positions_and_mask` gives for right padding, left padding and holes.

Why a gather/scatter around padded attention and not a block-diagonal causal mask over [1, N] (the CPU
has no varlen flash kernel such as FlashAttention's `cu_seqlens`): a dense mask over the packed row costs
N^2 scores (the study's batches, 128 sequences of ~9 real tokens, L = 13: N^2 ~ 1.4 M against
B L^2 ~ 22 k) and takes SDPA off its causal fast path; the grid costs what padded attention costs (at
these lengths attention is ~1% of a block's FLOPs, the linears the rest) plus index copies of q, k, v
and of the output (measured: 3-6% of a training step on a batch without padding, which the training
engine therefore runs on the padded path).

Numerics: per token the same operations as the padded path (row-wise ops, the same attention over the
same keys), so BF16/FP32 results differ by GEMM summation order at most. What changes is the set of
tokens a GEMM sees: FP8 wgrad re-quantizes dY and X in [128, 1] blocks along tokens, and padding rows
no longer share (and set the amax of) those blocks; so the key is part of a cell's id when on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Packed:
    """Where each of the N real tokens of a padded batch [B, T] sits (see the module docstring).

    index:     Long[N] its flat position b * T + t in the padded batch (row-major order)
    slot:      Long[N] its flat position b * L + j in the compact grid [B, L] of attention
    positions: Long[N] j, its place among its sequence's real tokens (the RoPE position)
    """

    index: torch.Tensor
    slot: torch.Tensor
    positions: torch.Tensor
    batch: int  # B
    length: int  # T
    max_len: int  # L: the longest sequence's real tokens (>= 1)

    @property
    def num_tokens(self) -> int:
        return int(self.index.numel())

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] -> its real tokens [N, ...]."""
        return x.reshape(self.batch * self.length, *x.shape[2:]).index_select(0, self.index)

    def put(self, values: torch.Tensor) -> torch.Tensor:
        """values [N, ...] -> [B, T, ...] at the real tokens, 0 elsewhere (differentiable)."""
        out = values.new_zeros((self.batch * self.length, *values.shape[1:]))
        return out.index_copy(0, self.index, values).view(self.batch, self.length, *values.shape[1:])

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, ...] -> the compact grid [B, L, ...]: sequence b in row b from column 0, zeros after."""
        out = x.new_zeros((self.batch * self.max_len, *x.shape[1:]))
        return out.index_copy(0, self.slot, x).view(self.batch, self.max_len, *x.shape[1:])

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, L, ...] -> the N real tokens [N, ...] (the inverse of to_grid on them)."""
        return x.reshape(self.batch * self.max_len, *x.shape[2:]).index_select(0, self.slot)


def pack(attention_mask: torch.Tensor) -> Packed:
    """The real tokens (attention_mask [B, T] true / 1) of a batch, in any padding layout."""
    real = attention_mask.bool()
    b, t = real.shape
    counts = real.long().cumsum(1)  # [B, T]: real tokens up to and including t
    index = real.reshape(-1).nonzero().squeeze(1)
    positions = (counts - 1).reshape(-1).index_select(0, index)
    max_len = max(int(counts[:, -1].max()) if t else 0, 1)
    slot = torch.div(index, max(t, 1), rounding_mode="floor") * max_len + positions
    return Packed(index=index, slot=slot, positions=positions, batch=b, length=t, max_len=max_len)
