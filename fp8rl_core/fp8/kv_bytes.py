"""Bytes of a generation engine's KV cache: the one formula the engines (engines/kv_quant.py, vllm_convert.py)
and the memory plan (distributed/memory_plan.py) share. Torch-free, so that the plan's layer can read it.

    kv_cache_bytes(L, B, Hkv, S, D, kv_cache="e4m3", kv_scale="trainer")   # a real E4M3 cache

`auto` (the compute dtype): dtype_bytes per element of K and V, 2 * L * B * Hkv * S * D elements. `e4m3`: 1 byte
per element plus the FP32 scales — per layer one K and one V scale (2 * L, trainer / first_forward), or one
per (layer, K|V, row, KV head, slot) (2 * L * B * Hkv * S, per_token_head). These are a real engine's bytes:
the native engine's CPU emulation stores the dequantized fl32(code * s) in FP32 (numerically identical, since
its attention multiplies codes and scales in FP32 first), which the plan does not count.
"""
from __future__ import annotations

SCALE_BYTES = 4  # one FP32 scale


def kv_cache_bytes(layers: int, batch: int, kv_heads: int, slots: int, head_dim: int, *, kv_cache: str = "e4m3",
                   kv_scale: str = "trainer", dtype_bytes: int = 2) -> int:
    """Bytes of K and V for `batch` rows of `slots` tokens over `layers` layers (see the module docstring);
    dtype_bytes: the compute dtype's bytes per element, read under kv_cache auto only."""
    elements = 2 * layers * batch * kv_heads * slots * head_dim
    if kv_cache == "auto":
        return elements * dtype_bytes
    if kv_cache != "e4m3":
        raise ValueError(f"fp8.kv_cache: unknown {kv_cache!r}; valid: auto, e4m3")
    scales = 2 * layers * (batch * kv_heads * slots if kv_scale == "per_token_head" else 1)
    return elements + SCALE_BYTES * scales
