"""The native generation engine: a Llama/Qwen2 sampler with inference-style kernels (the vLLM side of
the study's two engines; docs/design.md "The two engines").

It holds its own weight copy, rebuilt by `refit(weights)` from a Hugging Face-named state dict, and
runs the same math as HF Llama/Qwen2 with the kernels an inference engine uses, not a trainer's:
- fused projections: one [q|k|v] GEMM and one [gate|up] GEMM per layer (weights concatenated at refit;
  BF16 weights on the CPU prepacked once into oneDNN's layout, bitwise the same results);
- fused residual-add + RMSNorm (`add_rms_norm`): the residual stream is updated in place and normalised
  by torch's fused `rms_norm` kernel, which multiplies by the weight in FP32 before the single rounding
  (HF and the training engine round x/rms to the dtype first, then multiply);
- a RoPE cos/sin cache computed once (FP32, HF's rotate_half layout, cast to the dtype), gathered by
  position; rotate_half is a `roll` times a sign-folded sin, applied to q and k in one pass;
- prefill of each distinct prompt once (GRPO's G samples share it, like vLLM's prefix caching), in
  groups of equal length: no padding, causal SDPA without a mask (a dense varlen prefill);
- a preallocated KV cache, left-padded (positions count real tokens only, padded slots masked), then
  one-token decode steps for the whole batch with a grouped-query kernel (kv_cache.py); only the last
  position goes through the LM head. A prompt's results do not depend on its batch-mates beyond GEMM
  blocking numerics.

FP8 (a recipe whose `generation` side is set, fp8rl_core/config/recipe.py): every linear of the
transformer blocks (except the first/last N blocks the recipe keeps in the dtype) is quantized
[128, 128] once per refit from the engine's dtype copy (as vLLM quantizes the BF16 tensors it is
sent), and its activations [1, 128] per call (fp8rl_core.fp8.fp8_linear). Embeddings, norms,
attention and the LM head stay in the dtype. The KV cache stays in the dtype too, unless the recipe's
kv_cache is e4m3 (any recipe; engines/kv_quant.py): then K/V are stored as E4M3 codes and scales, and
prefill and decode attend over them in FP32.
Fused weights are quantized as one matrix, but each shard (q, k, v / gate, up) is first zero-padded to
a multiple of 128 rows: a [128, 128] block then never straddles two projections, so the fused
quantization equals per-projection quantization exactly (what HF block-FP8 checkpoints store and what
vLLM's QKV loader keeps); without the padding a block spanning e.g. the q/k boundary would share one
scale. The pad rows are zero and their output columns are dropped. The tiny presets need no padding.
Other formats (`Quantization.format`: tensorwise, mxfp8, nvfp4; fp8rl_core/fp8/formats.py) quantize each
projection on its own and stack the results (fp8.lowp.concat), so no block and no per-tensor scale spans two
projections and no padding is needed: the fused weight is exactly the trainer's per-projection Q(W), with one
tensor scale per projection for tensorwise and NVFP4 (vLLM's online per-tensor FP8 would requantize the fused
tensor to one scale). `quantized_linear` quantizes one unfused matrix (e.g. an FP8 LM head).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp8rl_core.config.recipe import BF16, Quantization, Recipe
from fp8rl_core.engines.base import GenerationOutput, SamplingParams
from fp8rl_core.engines.kv_cache import KVCache, decode_attention, group_prompts, prefill_attention
from fp8rl_core.engines.kv_quant import KVQuantizer, KVScales, check_not_default
from fp8rl_core.engines.sampling import sample_next, tempered, validate_sampling
from fp8rl_core.fp8 import Fp8Weight, QuantWeight, fp8_linear, quantize_weight
from fp8rl_core.fp8.lowp import concat as lowp_concat
from fp8rl_core.model import bf16
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.rope import inv_freq as rope_inv_freq

FP8_BLOCK = 128


@dataclass
class FusedLinear:
    """y = x W^T + b for a (possibly fused) W [N, K]; shard i is y[..., starts[i] : starts[i] + sizes[i]].

    weight: the dtype copy, or an Fp8Weight (E4M3 [N, K] + FP32 [ceil(N/128), ceil(K/128)] scales,
    bias inside it) for a block128 layer, or a QuantWeight (fp8.lowp; bias inside) for another format.
    """

    weight: torch.Tensor | Fp8Weight | QuantWeight
    bias: torch.Tensor | None
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    power_of_two: bool = False
    check_finite: bool = False
    packed: torch.Tensor | None = None  # oneDNN-blocked copy of `weight` (BF16 on CPU), see pack_for_cpu
    # emulated BF16 (the emulated BF16 path; model/bf16.py): FP32 copies of the BF16 weight and bias,
    # made once per refit (exact), that the product runs on
    upcast: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, (Fp8Weight, QuantWeight)):
            return fp8_linear(x, self.weight, power_of_two=self.power_of_two, check_finite=self.check_finite)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.upcast is not None:
            return bf16.linear_upcast(x, *self.upcast)
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self) -> None:
        """Reorder a BF16 CPU weight once into oneDNN's blocked layout, as inference runtimes prepack
        (torch.compile's CPU freezing does the same): F.linear would reorder it on every call. The
        result is bitwise that of F.linear; checked on a probe, and skipped where oneDNN is missing."""
        w = self.weight
        if (isinstance(w, (Fp8Weight, QuantWeight)) or w.dtype != torch.bfloat16 or w.device.type != "cpu"
                or self.upcast is not None):
            return
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 128)
            probe = torch.linspace(-1, 1, 3 * w.shape[1], dtype=w.dtype).view(3, -1)
            same = torch.equal(torch.ops.mkldnn._linear_pointwise(probe, packed, self.bias, "none", [], ""),
                               F.linear(probe, w, self.bias))
        except (AttributeError, RuntimeError):
            return
        self.packed = packed if same else None

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y[..., s:s + n] for s, n in zip(self.starts, self.sizes))


@dataclass
class Block:
    """One decoder layer's weights as the engine stores them."""

    attn_norm: torch.Tensor
    qkv: FusedLinear
    o: FusedLinear
    mlp_norm: torch.Tensor
    gate_up: FusedLinear
    down: FusedLinear


def fuse_linear(mats: list[torch.Tensor], biases: list[torch.Tensor | None], spec: Quantization | None,
                upcast_bf16: bool = False) -> FusedLinear:
    """Concatenate [N_i, K] weights along N (biases likewise); quantize when spec is given (FP8 layer).

    For block128 every shard of a fused weight is zero-padded to a multiple of 128 rows first (a single
    matrix is not); other formats quantize each shard on its own (see the module docstring).
    """
    sizes = tuple(m.shape[0] for m in mats)
    if spec is not None and spec.format != "block128":
        parts = [quantize_weight(m, None, quant=spec) for m in mats]
        bias = torch.cat([b if b is not None else mats[i].new_zeros(sizes[i]) for i, b in enumerate(biases)]) \
            if any(b is not None for b in biases) else None
        starts = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        return FusedLinear(lowp_concat(parts, bias), None, starts, sizes, False, spec.check_finite)
    # pad between shards only: one matrix has no boundary to straddle, and its partial last block (SmolLM2's
    # o_proj / down_proj: N = 576 = 4.5 x 128) is what the trainer's quantizer makes of it, with no pad columns
    # left in the output
    pad_to = FP8_BLOCK if spec is not None and len(mats) > 1 else 1
    padded = [-(-n // pad_to) * pad_to for n in sizes]
    starts = tuple(sum(padded[:i]) for i in range(len(padded)))
    has_bias = any(b is not None for b in biases)

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        if len(parts) == 1 and parts[0].shape[0] == padded[0]:
            return parts[0].clone()
        return torch.cat([F.pad(p, (0, 0) * (p.dim() - 1) + (0, r - p.shape[0])) for p, r in zip(parts, padded)])

    weight = cat(mats)
    bias = cat([b if b is not None else mats[i].new_zeros(sizes[i]) for i, b in enumerate(biases)]) \
        if has_bias else None
    if spec is None:
        linear = FusedLinear(weight, bias, starts, sizes)
        if upcast_bf16 and weight.dtype == torch.bfloat16:  # upcast once per refit, not per call (exact)
            linear.upcast = (weight.float(), None if bias is None else bias.float())
        linear.pack_for_cpu()
        return linear
    q = quantize_weight(weight, bias, quant=spec)  # block128 here: pow2 scales as spec.scale_format says
    return FusedLinear(q, None, starts, sizes, spec.power_of_two_scales, spec.check_finite)


def quantized_linear(weight: torch.Tensor, spec: Quantization, bias: torch.Tensor | None = None) -> FusedLinear:
    """One unfused [N, K] matrix quantized as `spec` says, without padding (nothing to straddle), e.g. an
    FP8 LM head: `quantized_linear(lm_head, recipe.generation)(hidden)` -> [..., N] in hidden's dtype."""
    q = quantize_weight(weight, bias, quant=spec)
    return FusedLinear(q, None, (0,), (weight.shape[0],), spec.power_of_two_scales, spec.check_finite)


ROPE_CACHE_START = 4096  # initial cache length (grown on demand): not a 131072-row cache for Llama-3.1


def rope_cache(head_dim: int, theta: float, length: int, dtype: torch.dtype, device: torch.device | str,
               scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin_signed [length, head_dim] for positions 0..length-1, computed in FP32 as HF does, cast to dtype.

    angle[p, j] = p * inv_freq_j (model/rope.py: theta^(-2j/D), then the config's linear / llama3
    scaling; j < D/2, duplicated over both halves); sin_signed negates the first half, so that
    rotate_half(x) * sin == roll(x, D/2) * sin_signed.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, device=device)
    angles = torch.arange(length, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    sin = emb.sin()
    sin[:, : head_dim // 2].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] -> x * cos + rotate_half(x) * sin, with cos/sin broadcast over the head dim."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place, in the dtype); return (rms_norm(residual) * weight, residual)."""
    residual.add_(x)
    return F.rms_norm(residual, weight.shape, weight, eps), residual


class NativeGenerationEngine:
    """GenerationEngine (fp8rl_core/engines/base.py) with a KV cache and inference-style kernels.

    config: the architecture; recipe: its `generation` side quantizes the block linears (None: all in
    `dtype`), its kept first/last blocks stay in `dtype`; dtype: dtype of the weight copy, activations,
    KV cache and logits (BF16; FP32 for tests); seed: seeds the engine's sampling generator;
    upcast_bf16: run every BF16 matrix product (linears, attention, LM head) as FP32 on the upcast
    operands, rounded to BF16 (the emulated BF16 path; fp8rl_core/model/bf16.py).

    recipe.kv_cache e4m3 (engines/kv_quant.py): K and V are quantized to E4M3 where they are written, and
    both prefill and decode attend over the dequantized values fl32(code * scale), in FP32 (q upcast,
    exact; the output rounded to the dtype once). With recipe.kv_scale trainer a refit must bring the
    scales computed with the same weights (`refit(weights, step=, kv_scales=)`); generate refuses stale
    or default ones. recipe.kv_cache auto: the cache in the dtype, as before.
    """

    def __init__(self, config: ModelConfig, *, recipe: Recipe = BF16, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", seed: int = 0, upcast_bf16: bool = False) -> None:
        self.config, self.recipe, self.dtype = config, recipe, dtype
        self.fp8 = recipe.fp8_generation
        self.upcast_bf16 = bool(upcast_bf16) and dtype == torch.bfloat16
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.blocks: list[Block] = []
        self.embed: torch.Tensor | None = None
        self.final_norm: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self._head32: torch.Tensor | None = None  # upcast_bf16: the LM head's FP32 copy (exact), per refit
        self._head_q: FusedLinear | None = None  # fp8.lm_head fp8: the quantized LM head, per refit
        self._cos, self._sin = rope_cache(config.head_dim, config.rope_theta,
                                          min(config.max_position_embeddings, ROPE_CACHE_START), dtype,
                                          self.device, config.rope_scaling)
        self.kv = KVQuantizer(recipe.kv_scale, recipe.kv_quantize_from, config.num_hidden_layers) \
            if recipe.kv_cache == "e4m3" else None
        self.weights_step: int | None = None  # the training step whose weights the last refit brought

    # ---- weights -------------------------------------------------------------------------------
    def is_fp8_block(self, layer: int) -> bool:
        """True when block `layer`'s linears run in FP8 (fp8 on, and not among the first/last kept ones)."""
        return self.fp8 and self.recipe.fp8_block(layer, self.config.num_hidden_layers)

    @torch.no_grad()
    def refit(self, weights: Mapping[str, torch.Tensor], *, step: int | None = None,
              kv_scales: KVScales | None = None) -> None:
        """Rebuild the engine's weight copy from HF-named tensors (any float dtype; copied, never aliased).

        step: the training step of these weights; kv_scales: the trainer's KV scales (kv_scale trainer),
        which must have been computed at `step` (checked at generate, not here: a refit may come first), or
        under kv_scale first_forward the scales a checkpoint kept for these weights (a resume).
        Raises KeyError naming missing/unexpected keys and ValueError naming a tensor of the wrong shape.
        """
        self.weights_step = step
        if self.kv is not None:
            self.kv.refit(step, kv_scales if self.kv.mode in ("trainer", "first_forward") else None)
        expected = expected_shapes(self.config)
        # shapes and dtypes only: from the shards of a sharded trainer's GatheredWeights (no all-gather)
        check_state_dict(getattr(weights, "shards", weights), expected, self.config.tie_word_embeddings)

        def get(name: str) -> torch.Tensor:
            return weights[name].detach().to(device=self.device, dtype=self.dtype, copy=True)

        def opt(name: str) -> torch.Tensor | None:
            return get(name) if name in expected else None

        quant = self.recipe.generation
        master = quant is not None and quant.quantize_from == "master"

        def src(name: str) -> torch.Tensor:
            """A weight an FP8 linear quantizes: as sent (fp8.quantize_from master: the FP32 master, what
            xtuner #2044 quantized) or its copy in the dtype (bf16: what a BF16 refit sends, as vLLM gets)."""
            return weights[name].detach().to(device=self.device, dtype=torch.float32, copy=True) if master \
                else get(name)

        blocks = []
        for i in range(self.config.num_hidden_layers):
            p = f"model.layers.{i}."
            spec = quant if self.is_fp8_block(i) else None
            w = src if spec is not None else get
            fuse = lambda mats, biases, spec=spec: fuse_linear(mats, biases, spec, self.upcast_bf16)  # noqa: E731
            attn, mlp = [p + f"self_attn.{n}_proj." for n in "qkv"], [p + f"mlp.{n}_proj." for n in ("gate", "up")]
            blocks.append(Block(
                attn_norm=get(p + "input_layernorm.weight"),
                qkv=fuse([w(n + "weight") for n in attn], [opt(n + "bias") for n in attn]),
                o=fuse([w(p + "self_attn.o_proj.weight")], [opt(p + "self_attn.o_proj.bias")]),
                mlp_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=fuse([w(n + "weight") for n in mlp], [None, None]),
                down=fuse([w(p + "mlp.down_proj.weight")], [None])))
        self.blocks = blocks
        self.embed = get("model.embed_tokens.weight")
        self.final_norm = get("model.norm.weight")
        head = "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = self.embed if self.config.tie_word_embeddings else get(head)
        self._head32 = self.lm_head.float() if self.upcast_bf16 else None
        # fp8.lm_head fp8: the head's linear quantized like the blocks' (recipe.lm_head; embeddings stay)
        fp8_head = quant is not None and self.recipe.lm_head == "fp8"
        self._head_q = quantized_linear(src(head), quant) if fp8_head else None

    # ---- forward -------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed gathered at positions Long[...] -> [..., 1, D] (broadcast over heads)."""
        need = int(positions.max()) + 1
        if need > self._cos.shape[0]:  # RoPE extrapolates; grow the cache rather than fail
            self._cos, self._sin = rope_cache(self.config.head_dim, self.config.rope_theta, 2 * need,
                                              self.dtype, self.device, self.config.rope_scaling)
        return self._cos[positions].unsqueeze(-2), self._sin[positions].unsqueeze(-2)

    def _qkv(self, blk: Block, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [..., hidden] -> q [..., Hq, D], k, v [..., Hkv, D], RoPE applied to q and k."""
        cfg, lead = self.config, h.shape[:-1]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        y = blk.qkv(h)
        q, k, v = blk.qkv.split(y)
        v = v.reshape(*lead, hkv, d)
        if blk.qkv.starts[1] == blk.qkv.sizes[0]:  # q and k adjacent (no FP8 padding): rotate in one pass
            qk = apply_rope(y[..., :(hq + hkv) * d].reshape(*lead, hq + hkv, d), cos, sin)
            return qk[..., :hq, :], qk[..., hq:, :], v
        return apply_rope(q.reshape(*lead, hq, d), cos, sin), apply_rope(k.reshape(*lead, hkv, d), cos, sin), v

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor,
                 attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """ids Long[...], positions Long (broadcastable to ids) -> final-normed hidden states [..., hidden].

        attend(layer, q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D]) -> [..., Hq * D] (rope applied).
        """
        eps = self.config.rms_norm_eps
        cos, sin = self._rope(positions)
        residual = F.embedding(ids, self.embed)
        h = F.rms_norm(residual, self.blocks[0].attn_norm.shape, self.blocks[0].attn_norm, eps)
        for i, blk in enumerate(self.blocks):
            a = attend(i, *self._qkv(blk, h, cos, sin))
            h, residual = add_rms_norm(blk.o(a), residual, blk.mlp_norm, eps)
            gate, up = blk.gate_up.split(blk.gate_up(h))
            nxt = self.blocks[i + 1].attn_norm if i + 1 < len(self.blocks) else self.final_norm
            h, residual = add_rms_norm(blk.down(F.silu(gate).mul_(up)), residual, nxt, eps)
        return h

    def _prefill(self, prompts: list[list[int]], cache: KVCache | None, width: int
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Run every distinct prompt once, in groups of equal length (no padding, causal attention
        without a mask), and store its keys/values in the cache rows of every row that uses it,
        right-aligned at slots [width - L, width) (left padding; padded slots stay zero).

        Yields (rows Long[R], which Long[R], hidden [U, L, hidden]): row rows[j] is prompt which[j].
        """
        for ids, rows, which in group_prompts(prompts, self.device):
            start = width - ids.shape[1]

            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor = rows,
                       start: int = start, which: torch.Tensor = which) -> torch.Tensor:
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [U, H, L, D]
                if self.kv is not None:  # E4M3 cache: prefill attends over what it stores too (FP32)
                    k, v = self.kv.apply(i, k, v)
                    q = q.float()
                if cache is not None:
                    cache.write_rows(i, rows, start, k[which], v[which])
                return prefill_attention(q, k, v, self.upcast_bf16).to(self.dtype)

            yield rows, which, self._forward(ids, torch.arange(ids.shape[1], device=self.device), attend)
            if self.kv is not None:
                self.kv.end_prefill()  # first_forward: the first group's forward set the scales

    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int, cache: KVCache) -> torch.Tensor:
        """tokens, positions Long[B] written at cache slot `slot` -> hidden [B, hidden]."""
        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if self.kv is not None:  # E4M3 cache (FP32 buffers of the dequantized values): attend in FP32
                k, v = self.kv.apply(i, k[:, :, None], v[:, :, None])
                k, v, q = k[:, :, 0], v[:, :, 0], q.float()
            cache.write(i, slot, k, v)
            return decode_attention(q, cache.k[i], cache.v[i], cache.visible, self.upcast_bf16).to(self.dtype)

        return self._forward(tokens, positions, attend)

    # ---- lifecycle (GenerationEngine): no server, no sleep mode -------------------------------------
    def start(self, model_dir: object = None) -> None:
        """Nothing to start: the first refit builds the weight copy."""

    def sleep(self, level: int = 2) -> None:
        """Nothing to release: the weight copy serves until the next refit (`release` drops it)."""

    def awake(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext(self)

    def tags(self) -> dict[str, str]:
        return {}

    def release(self) -> None:
        """Drop the weight copy (blocks, embedding, final norm, LM head and its FP32 / FP8 copies): the
        next use must be a refit (generate raises before)."""
        self.blocks = []
        self.embed = self.final_norm = self.lm_head = self._head32 = self._head_q = None

    def _check_ready(self) -> None:
        if not self.blocks:
            raise RuntimeError("NativeGenerationEngine: no weights; call refit(weights) first")
        if self.kv is not None and self.kv.mode == "trainer":
            self._check_kv_scales()

    def _check_kv_scales(self) -> None:
        """kv_scale trainer: the scales must be the trainer's for the weights in use, never defaults."""
        scales = self.kv.scales
        if scales is None:
            raise RuntimeError(f"KV cache (fp8.kv_scale trainer): the refit to the weights of step "
                               f"{self.weights_step} brought no KV scales; every layer would run with a "
                               "default scale (NeMo RL PR #3226). Refit with kv_scales from the trainer")
        if scales.step != self.weights_step:
            raise RuntimeError(f"KV cache (fp8.kv_scale trainer): stale KV scales, computed with the weights of "
                               f"step {scales.step}, while the weights in use are step {self.weights_step}")
        check_not_default(scales)

    def held_kv_scales(self) -> KVScales | None:
        """The per-layer KV scales this engine holds for its current weights (fp8.kv_scale trainer: the
        trainer's; first_forward: once its first prefill computed them; None otherwise). A checkpoint keeps
        them and a resume hands them back (refit(kv_scales=)), so that it generates as the uninterrupted run."""
        if self.kv is None or self.kv.mode not in ("trainer", "first_forward") or self.kv.pending:
            return None
        return self.kv.scales

    def kv_scales_in_use(self) -> tuple[float, float] | None:
        """(step, checksum) of the KV scales the last generate call used: the training step whose weights
        they were computed with (-1: unknown) and kv_quant.checksum of them; None without an E4M3 KV cache."""
        if self.kv is None:
            return None
        step, total = self.kv.in_use()
        return float(step if step is not None else -1), total

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Prefill-only forward (the path `generate` prefills with), for tests and scoring.

        input_ids Long[B, T]; attention_mask Bool[B, T] with one contiguous run of real tokens per row
        (left or right padding). Returns Float32[B, T, V]: the dtype logits upcast, 0 on padding.
        """
        self._check_ready()
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        starts, prompts = [], []
        for ids_row, m in zip(input_ids.tolist(), mask.tolist()):
            real = [j for j, keep in enumerate(m) if keep]
            if not real or real != list(range(real[0], real[-1] + 1)):
                raise ValueError("attention_mask: each row needs one contiguous run of real tokens")
            starts.append(real[0])
            prompts.append(ids_row[real[0]:real[-1] + 1])
        out = torch.zeros(*input_ids.shape, self.config.vocab_size, device=self.device)
        for rows, which, hidden in self._prefill(prompts, None, input_ids.shape[1]):
            logits = self._head(hidden).float()
            for row, w in zip(rows.tolist(), which.tolist()):
                out[row, starts[row]:starts[row] + logits.shape[1]] = logits[w]
        return out

    # ---- generation ----------------------------------------------------------------------------
    @property
    def pad_id(self) -> int:
        return self.config.pad_id

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts: need at least one prompt, and every prompt needs >= 1 token")
        low, high = min(min(p) for p in prompts), max(max(p) for p in prompts)
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"prompts: token ids must lie in [0, {self.config.vocab_size}), got [{low}, {high}]")

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] in the dtype (the LM head in the dtype: BF16, or
        quantized like the blocks' linears with fp8.lm_head fp8)."""
        if self._head_q is not None:
            return self._head_q(hidden)
        if self._head32 is not None:  # emulated BF16, the weight upcast once per refit
            return bf16.linear_upcast(hidden, self._head32)
        return F.linear(hidden, self.lm_head)

    def _start(self, prompts: list[list[int]], steps: int) -> tuple[KVCache, torch.Tensor, torch.Tensor, int]:
        """Prefill every prompt into a fresh cache with room for `steps` new tokens.

        Returns (cache, logits [B, V] of the next token, prompt lengths Long[B], width = longest prompt)."""
        cfg, dev = self.config, self.device
        b, width = len(prompts), max(len(p) for p in prompts)
        if self.kv is not None:
            self.kv.begin_call()
        cache = KVCache(cfg.num_hidden_layers, b, cfg.num_key_value_heads, width + steps, cfg.head_dim,
                        torch.float32 if self.kv is not None else self.dtype, dev)
        last = torch.empty(b, cfg.hidden_size, dtype=self.dtype, device=dev)
        for rows, which, hidden in self._prefill(prompts, cache, width):
            last[rows] = hidden[which, -1]
        return cache, self._head(last), torch.tensor([len(p) for p in prompts], device=dev), width

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample up to sampling.max_new_tokens tokens after each prompt (see GenerationOutput).

        R (the output width) is the number of decode steps run: max_new_tokens, or fewer when every
        row has emitted EOS (any id of config.eos_ids: Llama-3.1-Instruct ends a turn with its third).
        A row keeps emitting pad after its EOS (masked out, log-prob 0).
        """
        self._check_ready()
        validate_sampling(sampling)
        self._check_prompts(prompts)
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        steps, dev = sampling.max_new_tokens, self.device
        cache, logits, lengths, width = self._start(prompts, steps)
        b = len(prompts)
        out_ids = torch.full((b, steps), self.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros((b, steps), dtype=torch.float32, device=dev)
        out_mask = torch.zeros((b, steps), dtype=torch.bool, device=dev)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        stops = torch.tensor(self.config.eos_ids, dtype=torch.long, device=dev)  # every EOS id ends a row
        taken = 0
        for step in range(steps):
            tokens, logp = sample_next(logits, sampling, self.generator)
            out_ids[:, step] = tokens.masked_fill_(done, self.pad_id)
            out_lp[:, step] = logp.masked_fill_(done, 0.0)
            out_mask[:, step] = ~done
            if len(stops):
                done |= torch.isin(tokens, stops)
            taken = step + 1
            if taken == steps or bool(done.all()):
                break
            logits = self._head(self._decode(tokens, lengths + step, width + step, cache))
        return GenerationOutput(out_ids[:, :taken], out_mask[:, :taken], out_lp[:, :taken], done.clone())

    @torch.no_grad()
    def score(self, prompts: list[list[int]], output: GenerationOutput, temperature: float) -> torch.Tensor:
        """Float32[B, R]: log_softmax(logits / T)[token] of `output`'s tokens, replaying `generate`'s own
        computation (engines.kernels: matched): the same prefill groups, the same [B]-row decode steps in
        the same order (done rows fed pad, as generate feeds them), the same LM-head and log-softmax ops.
        On an engine with the generating engine's weights and settings this returns output.logprobs
        bit for bit; 0 where output.response_mask is False."""
        self._check_ready()
        self._check_prompts(prompts)
        ids, mask = output.response_ids.to(self.device), output.response_mask.to(self.device)
        steps = ids.shape[1]
        cache, logits, lengths, width = self._start(prompts, steps)
        out = torch.zeros(ids.shape, dtype=torch.float32, device=self.device)
        for step in range(steps):
            logp = torch.log_softmax(tempered(logits, temperature), dim=-1)
            out[:, step] = logp.gather(-1, ids[:, step, None]).squeeze(-1)
            if step + 1 < steps:
                logits = self._head(self._decode(ids[:, step], lengths + step, width + step, cache))
        return out.masked_fill_(~mask, 0.0)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF state-dict names of a Llama/Qwen2 checkpoint -> their shapes (o_proj bias: Llama attention_bias)."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
            if cfg.model_type == "llama":  # HF Llama's attention_bias covers o_proj too; Qwen2's does not
                shapes[p + "self_attn.o_proj.bias"] = (h,)
    return shapes


def check_state_dict(weights: Mapping[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                     tied: bool) -> None:
    """Raise KeyError for missing or unexpected names, ValueError for a wrong shape.

    Tolerated extras: lm_head.weight of a tied model (HF state dicts list it) and rotary inv_freq buffers.
    """
    missing = sorted(set(expected) - set(weights))
    extra = sorted(k for k in weights if k not in expected
                   and not (tied and k == "lm_head.weight") and not k.endswith("rotary_emb.inv_freq"))
    if missing or extra:
        more = lambda names: f"{names[:8]}{' ...' if len(names) > 8 else ''}"  # noqa: E731
        raise KeyError(f"refit: state dict does not match the model config; missing: {more(missing)}; "
                       f"unexpected: {more(extra)}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"refit: {name} has shape {tuple(weights[name].shape)}, expected {shape}")
        if not weights[name].is_floating_point():
            raise ValueError(f"refit: {name} has dtype {weights[name].dtype}, expected a floating dtype")
