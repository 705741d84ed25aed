"""Building blocks of the policy model, written as a training engine runs them.

Training-style kernels (Megatron-Core's choices, not vLLM's): separate q/k/v and gate/up projections,
`F.scaled_dot_product_attention` over the whole sequence (causal), RMSNorm and RoPE computed on the
fly in every forward. The generation engine (fp8rl_core/engines/native_gen.py) implements the same
math with inference-style kernels (fused projections, a cos/sin cache, a KV cache); that engineering
difference is what the mismatch metric measures, so nothing here is shared with it.

Linear layers are plain `nn.Linear`; FP8 recipes swap them for `Fp8Linear` afterwards
(fp8rl_core/model/fp8_policy.py), which keeps the parameter names.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl_core.model import bf16
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.packing import Packed
from fp8rl_core.model.rope import inv_freq as rope_inv_freq


class RMSNorm(nn.Module):
    """y = w * (x / sqrt(mean(x^2, -1) + eps)): statistics in FP32, the product in x's dtype.

    As HF with weights in x's dtype; under autocast (FP32 masters, BF16 stream) the weight is cast to
    BF16 so that the output stays BF16, as Megatron-Core / Transformer Engine's norms return it.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(dtype) * h.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, 1, T, head_dim] for positions Long[B, T], computed in FP32, cast to dtype.

    inv_freq from model/rope.py (1 / theta^(2j / head_dim), then the config's linear / llama3 scaling),
    angle = position * inv_freq, duplicated over both halves (HF's rotate_half layout, not the
    interleaved one); computed on the fly at every call, as a trainer does.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=positions.device)
    with torch.autocast(positions.device.type, enabled=False):
        angles = positions[..., None].float() * inv_freq  # [B, T, head_dim / 2]
        emb = torch.cat((angles, angles), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (halves, HF layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated: x * cos + rotate_half(x) * sin."""
    return x * cos + rotate_half(x) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     upcast_bf16: bool = False) -> torch.Tensor:
    """SDPA of q, k, v [B, H, T, D] (causal, or the Bool mask [B, 1, T, T]) -> [B, H, T, D] in q's dtype.

    On the CPU, BF16 inputs are always upcast and attended in FP32 (model/bf16.py `sdpa`, emulated):
    the upcast is exact (the values are BF16), the kernel accumulates and normalises in FP32 as GPU
    flash kernels do, and without AMX torch's BF16 flash-attention backward is ~4x slower than FP32 at
    our shapes (measured: B=128, H=4, T=16, D=64 fwd+bwd 38 ms BF16 vs 9 ms FP32, 1 thread).
    Elsewhere: SDPA as is, unless `upcast_bf16` (the emulated BF16 path, model/bf16.py).
    """
    upcast = upcast_bf16 or q.device.type == "cpu"
    return bf16.sdpa(q, k, v, emulate=upcast, attn_mask=mask, is_causal=mask is None)


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE; q/k/v bias for Qwen2 (and Llama's attention_bias)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        h, qkv_bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=qkv_bias)
        # HF Llama's attention_bias also puts a bias on o_proj; Qwen2's o_proj never has one.
        o_bias = qkv_bias and cfg.model_type == "llama"
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=o_bias)
        self.upcast_bf16 = False  # BF16 attention on FP32 upcasts (model/bf16.py: upcast_bf16_matmuls)
        # called as kv_observer(k, v) with post-RoPE k and v [B, Hkv, T, D] (packed: [1, Hkv, N, D]) when set:
        # the trainer's KV-scale calibration reads them (engines/native_train.py kv_scales); reads only
        self.kv_observer = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                packed: Packed | None = None) -> torch.Tensor:
        """x [B, T, hidden], positions Long[B, T], mask Bool[B, 1, T, T] (True = attend) or None (causal).

        packed (model/packing.py): x [1, N, hidden] holds the real tokens of a batch, positions [1, N];
        attention runs per sequence on packed.to_grid(q, k, v) (causal) and returns to the N tokens."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, q.dtype, self.rope_scaling)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        if packed is not None:  # [1, heads, N, D] -> [B, heads, L, D]: one row per sequence
            q, k, v = (packed.to_grid(z[0].transpose(0, 1)).transpose(1, 2) for z in (q, k, v))
        if self.n_kv != self.n_heads:  # GQA: each kv head serves n_heads / n_kv query heads
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = causal_attention(q, k, v, mask, self.upcast_bf16).transpose(1, 2)  # [B, T or L, heads, D]
        if packed is not None:
            out = packed.from_grid(out)[None]  # [1, N, heads, D]
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as separate projections."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)  # declaration order = HF's, so state_dict key order matches too
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                packed: Packed | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, packed)
        return x + self.mlp(self.post_attention_layernorm(x))
