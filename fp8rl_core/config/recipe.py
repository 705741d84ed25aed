"""The recipe, resolved once: what each engine quantizes and how, as one object of plain values.

    recipe = resolve_recipe("fp8_e2e", Fp8Spec(bf16_last_layers=1))   # at the edge (config.recipe_of(cfg))
    recipe.generation        # Quantization | None: the generation engine's linears (None: BF16)
    recipe.training          # Quantization | None: the trainer's Fp8Linear forward and backward
    recipe.fp8_block(i, L)   # does block i of L run its linears in FP8 (first/last N kept BF16)?

The registry names the study's recipes (which engine runs FP8); the run config's `fp8` section supplies
the knobs. Engines, Fp8Linear's conversion, the converters to vLLM and Megatron, the memory plan and
`explain` receive this object, never a recipe name or the run config. A new recipe is one registry
entry; a new quantization knob is one `Quantization` field (fp8rl_core/fp8/quantization.py, beside the
kernels) named as its `fp8.*` key (resolve_recipe copies it) plus the kernel that reads it.

Torch-free: the sweep driver validates recipe names without importing torch.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from fp8rl_core.fp8.quantization import Quantization  # the kernels' configuration, re-exported here

__all__ = ["BF16", "RECIPES", "RECIPE_KNOBS", "VLLM_KV_CACHE_REFUSALS", "Quantization", "Recipe", "get_recipe",
           "resolve_recipe", "vllm_kv_cache_error"]


@dataclass(frozen=True)
class Recipe:
    """One arm of the study, resolved: each engine's quantization (None: BF16) and the layers kept BF16.
    Attention, norms, embeddings and the LM head stay BF16 in every recipe."""

    name: str
    generation: Quantization | None = None
    training: Quantization | None = None
    bf16_first_layers: int = 0  # the first N transformer blocks keep all their linears in BF16
    bf16_last_layers: int = 0  # and the last N
    lm_head: str = "bf16"  # "fp8": the LM head's linear is quantized too (by each engine's side)
    # the generation engine's KV cache (engines/kv_quant.py): auto (the compute dtype) | e4m3, its scales
    # (trainer | first_forward | per_token_head) and what is quantized (bf16 | compute); any recipe, bf16 too
    kv_cache: str = "auto"
    kv_scale: str = "trainer"
    kv_quantize_from: str = "bf16"
    description: str = ""

    @property
    def fp8_generation(self) -> bool:
        return self.generation is not None

    @property
    def fp8_training(self) -> bool:
        return self.training is not None

    def bf16_blocks(self, num_layers: int) -> list[int]:
        """Indices of the blocks that stay BF16: the first and the last N (they may overlap)."""
        first = range(min(self.bf16_first_layers, num_layers))
        last = range(max(0, num_layers - self.bf16_last_layers), num_layers)
        return sorted(set(first) | set(last))

    def fp8_block(self, layer: int, num_layers: int) -> bool:
        """Whether block `layer`'s linears are FP8-eligible (the engine's own side decides if they are FP8)."""
        return layer not in self.bf16_blocks(num_layers)

    def fp8_exclusions(self, num_layers: int) -> tuple[str, ...]:
        """fnmatch patterns of module names that stay BF16: lm_head (unless lm_head is fp8) and every
        linear of the kept blocks."""
        head = () if self.lm_head == "fp8" else ("lm_head",)
        return (*head, *(f"model.layers.{i}.*" for i in self.bf16_blocks(num_layers)))

    def in_bf16(self) -> Recipe:
        """Both engines in BF16 (the engine-neutral evaluation engine beside an FP8 arm), its KV cache too."""
        return replace(RECIPES["bf16"], bf16_first_layers=self.bf16_first_layers,
                       bf16_last_layers=self.bf16_last_layers, lm_head=self.lm_head)


_FP8 = Quantization()
RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("bf16", description="baseline: BF16 generation and training"),
        Recipe("fp8_gen", generation=_FP8, description="candidate 1: FP8 linear layers in generation only"),
        Recipe("fp8_e2e", generation=_FP8, training=_FP8,
               description="final: FP8 linear layers in generation and training (fwd + bwd)"),
    )
}
BF16 = RECIPES["bf16"]


def get_recipe(name: str) -> Recipe:
    """The registry entry `name`, with default knobs; an unknown name lists the known ones."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"recipe: unknown recipe {name!r}; valid: {', '.join(RECIPES)}") from None


RECIPE_KNOBS = ("bf16_first_layers", "bf16_last_layers", "lm_head",  # the run config's fp8.* keys a Recipe holds
                "kv_cache", "kv_scale", "kv_quantize_from")


# Why vLLM 0.32.0 (CPU build) cannot hold our E4M3 KV cache, per fp8.kv_scale design (read in its source; docs/design.md
# "FP8 KV cache"). Its CPU attention backend takes kv_cache_dtype fp8 | fp8_e4m3 | fp8_e5m2 with AVX-512 or AMX only
# (v1/attention/backends/cpu_attn.py, _get_attn_isa), with one K and one V scale per layer, 1.0 unless the
# checkpoint holds them (NeMo RL PR #3226's silent failure).
VLLM_KV_CACHE_REFUSALS = {
    "trainer": "vLLM cannot take new per-layer KV scales at a refit without a patch: "
               "BaseKVCacheMethod.process_weights_after_loading (vllm/model_executor/layers/quantization/"
               "kv_cache.py) deletes the k_scale / v_scale parameters after the first load, a reload then skips "
               "them ('no weights to process'), and the CPU attention reads layer._k_scale_float, a float copied once",
    "first_forward": "vLLM no longer computes KV scales from the first forward (calculate_kv_scales is gone); "
                     "its FP8 cache would run at the checkpoint's scales or 1.0",
    "per_token_head": "vLLM's CPU attention backend has no per-token-head KV dtype (CPUAttentionBackend."
                      "supported_kv_cache_dtypes: auto, fp8, fp8_e4m3, fp8_e5m2; one scale per layer)",
}


def vllm_kv_cache_error(recipe: Recipe) -> str | None:
    """Why the vLLM engine refuses this recipe's KV cache (None: `auto`, vLLM's cache in the compute dtype)."""
    if recipe.kv_cache == "auto":
        return None
    return (f"fp8.kv_cache: {recipe.kv_cache!r} with fp8.kv_scale {recipe.kv_scale!r} cannot run in "
            f"engines.generation 'vllm': {VLLM_KV_CACHE_REFUSALS[recipe.kv_scale]}; valid: fp8.kv_cache auto with "
            f"engines.generation vllm, or engines.generation native (every kv_scale)")


def resolve_recipe(name: str, knobs: Any = None) -> Recipe:
    """Recipe `name` with the knobs of `knobs` (the run config's Fp8Spec, or any object with those
    attributes): every Quantization field and RECIPE_KNOBS are copied by name; scale_format "auto" is
    resolved (`knobs.resolved_scale_format()`: pow2 with power_of_two_scales, else the format's default)."""
    recipe = get_recipe(name)
    if knobs is None:
        return recipe
    pick = lambda cls: {f.name: getattr(knobs, f.name) for f in fields(cls) if hasattr(knobs, f.name)}  # noqa: E731
    picked = pick(Quantization)
    if hasattr(knobs, "resolved_scale_format"):
        picked["scale_format"] = knobs.resolved_scale_format()
    quant = Quantization(**picked)
    layers = {k: v for k, v in pick(Recipe).items() if k in RECIPE_KNOBS}
    return replace(recipe, generation=quant if recipe.fp8_generation else None,
                   training=quant if recipe.fp8_training else None, **layers)
