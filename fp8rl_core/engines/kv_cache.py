"""The generation engine's preallocated KV cache and the two attention kernels that read it.

Shapes: B rows, S cache slots (prompt + new tokens), T prompt length (left-padded), Hq query heads,
Hkv key/value heads (grouped-query attention: Hq = G * Hkv), D head dim.

Layout: keys and values of one layer live in `k[l], v[l]`: [B, Hkv, S, D], allocated (zeroed) once per
`generate` call. A prompt of length L fills slots [T - L, T) (left padding; the padded slots stay zero,
so that masked scores and values are finite); decode step s writes slot T + s. Every row writes the
same slot at the same step, so one additive bias [B, 1, 1, S] (-inf on a row's padding) is all the
decode attention needs.

Kernels, as an inference engine has them (vLLM: flash-attention varlen for prefill, a paged/flash-decode
kernel for decode), not as a trainer has them:
- prefill: `scaled_dot_product_attention`, causal, over groups of equal-length prompts (no padding, no
  mask: the dense-tensor form of a varlen prefill);
- decode: one query per row against the cache, grouped so that the G query heads of one KV head share
  one batched matmul (no repeat of K/V); scores and softmax in FP32, probabilities cast back to the cache
  dtype for the P@V matmul. Measured here (B=128, Hkv=2, 44 slots, BF16): 0.36 ms vs 7.2 ms for SDPA
  with a mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values for L layers: k[l], v[l] are [B, Hkv, S, D] buffers in `dtype`."""

    def __init__(self, layers: int, batch: int, kv_heads: int, slots: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (batch, kv_heads, slots, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots = slots

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, Hkv, n, D] at slots [start, start + n); return views of slots [0, start + n)."""
        end = start + k.shape[2]
        if end > self.slots:
            raise IndexError(f"KVCache: slot {end - 1} beyond the {self.slots} allocated")
        self.k[layer][:, :, start:end].copy_(k)
        self.v[layer][:, :, start:end].copy_(v)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def write_rows(self, layer: int, rows: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [R, Hkv, n, D] into batch rows Long[R] at slots [start, start + n) (prefill)."""
        end = start + k.shape[2]
        if start < 0 or end > self.slots:
            raise IndexError(f"KVCache: slots [{start}, {end}) outside the {self.slots} allocated")
        self.k[layer][rows, :, start:end] = k
        self.v[layer][rows, :, start:end] = v


def decode_bias(key_valid: torch.Tensor) -> torch.Tensor:
    """Bool[B, S] -> Float32[B, 1, 1, S] additive bias: 0 on real slots, -inf on left padding."""
    bias = torch.zeros(key_valid.shape, dtype=torch.float32, device=key_valid.device)
    return bias.masked_fill_(~key_valid, float("-inf"))[:, None, None, :]


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, T, D], k/v [B, Hkv, T, D] of unpadded equal-length prompts -> [B, T, Hq * D].

    Causal softmax(q k^T / sqrt(D)) v per head, K/V shared by groups of Hq / Hkv query heads.
    """
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    b, h, t, d = out.shape
    return out.transpose(1, 2).reshape(b, t, h * d)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """One new token per row against the cache.

    q [B, Hq, D]; k/v [B, Hkv, n, D] (cache slots [0, n), the new token's included);
    bias Float32[B, 1, 1, n] (0 or -inf) -> [B, Hq * D].
    scores = (q_g k^T) / sqrt(D) + bias in FP32, p = softmax(scores), out = p v, where q_g [B, Hkv, G, D]
    groups the G = Hq / Hkv query heads that read the same KV head.
    """
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, hq // hkv, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(d ** -0.5).add_(bias)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).view(b, hq * d)
