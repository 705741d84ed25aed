"""The FP8 (E4M3) KV cache of the native generation engine: codes, scales and where the scales come from
(`fp8.kv_cache: e4m3`, `fp8.kv_scale`, `fp8.kv_quantize_from`; docs/design.md "FP8 KV cache").

Stored value of an element x of K or V (per layer): `code = E4M3(clamp(src(x) / s, -448, 448))`, FP32
division, round to nearest even (torch's float8_e4m3fn cast, the one fp8/kernels.py's quantizer uses);
the attention reads `fl32(code * s)`. src(x) is x rounded to BF16 first (`kv_quantize_from: bf16`, as
SGLang PR #31086 quantizes BF16 K/V) or x as the compute dtype holds it (`compute`); both are the same
when the compute dtype is BF16. Q is neither quantized nor scaled. Scales s (FP32):

- trainer (NeMo RL): per layer, one for K and one for V, computed by the trainer after each step on that
  step's batch under the new weights (`trainer_scales`) and sent with the refit;
- first_forward (vLLM's `calculate_kv_scales`, verl PR #4435): per layer, from the first prefill forward
  after each refit, `amax(K) / 200`, `amax(V) / 100` (vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT in
  vllm/envs.py, read by `calc_kv_scales` in vllm/attention/layer.py), then kept until the next refit;
- per_token_head (vLLM PR #38378): per (row, KV head, slot), `amax over D / 448`, computed at the write.

A scale of 0 (an all-zero tensor) becomes 1.0, as for the linears (no NaN, ever).

Memory: a real FP8 cache holds 1 byte per element plus the FP32 scales: 2 * L * B * Hkv * S * D bytes
plus 2 * L * 4 (per-layer scales) or 2 * L * B * Hkv * S * 4 (per_token_head). The CPU emulation stores
the dequantized values fl32(code * s) in FP32 instead (`kv_cache_bytes`, fp8/kv_bytes.py, says what a real
engine needs, and the memory plan counts that): numerically the same as reading the codes and scales back,
since the attention computes in FP32 on them.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from fp8rl_core.fp8.kernels import E4M3_MAX, FP8_DTYPE
from fp8rl_core.fp8.kv_bytes import kv_cache_bytes  # noqa: F401  the one formula (re-exported: kv_quant.kv_cache_bytes)

K_SCALE_CONSTANT = 200.0  # vLLM's envs.K_SCALE_CONSTANT: first_forward's K range
V_SCALE_CONSTANT = 100.0  # vLLM's envs.V_SCALE_CONSTANT: first_forward's V range
TRAINER_PERCENTILE = 0.999  # NeMo RL: the 99.9th percentile of the per-forward amaxes ...
TRAINER_MARGIN = 1.05  # ... times 1.05, / 448
# a trainer scale of exactly 1.0 on a layer whose amax / 448 lies outside [1/64, 64]: a default scale
# (NeMo RL PR #3226: every layer silently at 1.0), refused
DEFAULT_SCALE_BAND = (1 / 64, 64.0)


@dataclass(frozen=True)
class KVScales:
    """Per-layer FP32 scales k[L], v[L], computed with the weights of training step `step`; amax_k/amax_v:
    the amaxes they came from (Float32[L]; the default-scale check reads them), None when unknown."""

    k: torch.Tensor
    v: torch.Tensor
    step: int
    amax_k: torch.Tensor | None = None
    amax_v: torch.Tensor | None = None

    def checksum(self) -> float:
        return checksum(self.k, self.v)


def checksum(k: torch.Tensor, v: torch.Tensor) -> float:
    """crc32 of the FP32 bytes of [k, v], kept to 24 bits: an integer exact in a float metric."""
    data = torch.cat([k.detach().float().reshape(-1), v.detach().float().reshape(-1)]).cpu().numpy().tobytes()
    return float(zlib.crc32(data) & 0xFFFFFF)


def nonzero(scale: torch.Tensor) -> torch.Tensor:
    """FP32 scale with 0 replaced by 1.0 (an all-zero tensor)."""
    scale = scale.float()
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def source(x: torch.Tensor, quantize_from: str) -> torch.Tensor:
    """What is quantized, in FP32: x rounded to BF16 first (bf16) or x as it is (compute)."""
    return (x.to(torch.bfloat16) if quantize_from == "bf16" else x).float()


def e4m3_codes(x32: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of FP32 x32 with the dequantization multiplier `scale` (broadcast): RNE, saturating."""
    return (x32 / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def fake_quant(x: torch.Tensor, scale: torch.Tensor, quantize_from: str) -> torch.Tensor:
    """fl32(code * scale) of x: what the attention reads from an FP8 cache. FP32, x's shape."""
    return e4m3_codes(source(x, quantize_from), scale).float().mul_(scale)


def per_token_head_scale(x32: torch.Tensor) -> torch.Tensor:
    """x32 [..., D] -> [..., 1]: amax over D / 448 per (row, head, slot) (1.0 where all zero)."""
    return nonzero(x32.abs().amax(dim=-1, keepdim=True) / E4M3_MAX)


def trainer_scales(k_amax: torch.Tensor, v_amax: torch.Tensor, step: int, mesh=None) -> KVScales:
    """k_amax, v_amax Float[F, L]: the amax of post-RoPE K and of V per forward (micro-batch) and layer.

    s = quantile_{0.999}(amax over forwards) * 1.05 / 448 (torch.quantile's linear interpolation, in
    float64; one forward: its amax), then the max over ranks (mesh.all_reduce_max), FP32; 0 -> 1.0.
    """
    def one(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.quantile(amax.double(), TRAINER_PERCENTILE, dim=0)
        return (a * TRAINER_MARGIN / E4M3_MAX).float(), amax.double().amax(dim=0).float()

    (k, ka), (v, va) = one(k_amax), one(v_amax)
    if mesh is not None and mesh.distributed:
        n = k.numel()
        red = mesh.all_reduce_max(torch.cat([k, v, ka, va]).tolist()).float()
        k, v, ka, va = red[:n], red[n:2 * n], red[2 * n:3 * n], red[3 * n:]
    return KVScales(nonzero(k), nonzero(v), step, ka, va)


def check_not_default(scales: KVScales) -> None:
    """Refuse a scale of exactly 1.0 on a layer whose amax / 448 lies outside DEFAULT_SCALE_BAND: that is
    a default left in place (NeMo RL PR #3226), not a calibrated scale."""
    if scales.amax_k is None:
        return
    lo, hi = DEFAULT_SCALE_BAND
    for name, s, a in (("K", scales.k, scales.amax_k), ("V", scales.v, scales.amax_v)):
        r = a.float() / E4M3_MAX
        bad = ((s == 1.0) & ((r < lo) | (r > hi)) & (a > 0)).nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(f"KV cache: the {name} scale of layer {bad[0]} is exactly 1.0 while its amax is "
                               f"{float(a[bad[0]]):.4g} (amax/448 outside [1/64, 64]): a default scale, not a "
                               "calibrated one (NeMo RL PR #3226)")


class KVQuantizer:
    """The generation engine's E4M3 KV state between refits: the mode, the per-layer scales in use (trainer,
    first_forward) and what `apply` quantizes with. Shapes: k, v [..., Hkv, n, D] as the cache takes them."""

    def __init__(self, mode: str, quantize_from: str, layers: int) -> None:
        self.mode, self.quantize_from, self.layers = mode, quantize_from, layers
        self.scales: KVScales | None = None
        self._step: int | None = None  # first_forward / per_token_head: the step of the weights refit
        self.pending = False  # first_forward: the next prefill computes the scales (set by a refit)
        self._k = [None] * layers  # first_forward: scales being computed layer by layer
        self._v = [None] * layers
        self._written = torch.zeros(2, layers)  # per_token_head: the largest scale written per layer (checksum)

    def refit(self, step: int | None, scales: KVScales | None) -> None:
        """New weights of training step `step`. trainer: `scales` are the trainer's for them. first_forward:
        the next prefill computes the scales, unless `scales` (computed with these weights, kept by a
        checkpoint) are handed back: a resume then uses what the uninterrupted run used."""
        self.scales = scales
        if self.mode == "first_forward":
            kept = scales is not None and scales.step == step
            self.pending, self.scales = not kept, scales if kept else None
            self._k, self._v = [None] * self.layers, [None] * self.layers
            self._step = step
        elif self.mode == "per_token_head":
            self._step = step

    def begin_call(self) -> None:
        if self.mode == "per_token_head":
            self._written = torch.zeros(2, self.layers)

    def end_prefill(self) -> None:
        """The first forward after a refit is done: its scales serve until the next refit."""
        if self.mode == "first_forward" and self.pending:
            self.pending = False
            self.scales = KVScales(torch.stack(self._k).cpu(), torch.stack(self._v).cpu(), self._step)

    def apply(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v -> fl32(code * scale) of each (FP32), with this layer's scales (computed here first under
        first_forward's pending prefill, or per (row, head, slot) under per_token_head)."""
        k32, v32 = source(k, self.quantize_from), source(v, self.quantize_from)
        if self.mode == "per_token_head":
            ks, vs = per_token_head_scale(k32), per_token_head_scale(v32)
            self._written[0, layer] = torch.maximum(self._written[0, layer], ks.max().cpu())
            self._written[1, layer] = torch.maximum(self._written[1, layer], vs.max().cpu())
        else:
            if self.mode == "first_forward" and self.pending and self._k[layer] is None:
                self._k[layer] = nonzero(k32.abs().amax() / K_SCALE_CONSTANT)
                self._v[layer] = nonzero(v32.abs().amax() / V_SCALE_CONSTANT)
            ks, vs = self.layer_scales(layer)
        return e4m3_codes(k32, ks).float().mul_(ks), e4m3_codes(v32, vs).float().mul_(vs)

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mode == "first_forward" and self.pending:
            return self._k[layer], self._v[layer]
        if self.scales is None:
            raise RuntimeError("KV cache: no KV scales (refit without them)")
        return self.scales.k[layer], self.scales.v[layer]

    def in_use(self) -> tuple[int, float]:
        """(kv_scale_step, kv_scale_checksum) of the scales the last generate call used."""
        if self.mode == "per_token_head":
            return self._step, checksum(self._written[0], self._written[1])
        if self.scales is None:
            raise RuntimeError("KV cache: no KV scales in use yet")
        return self.scales.step, self.scales.checksum()
