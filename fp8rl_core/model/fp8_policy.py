"""The trainer's side of the recipe: swap the policy model's linear layers for blockwise FP8.

Which layers: the recipe object's rule (fp8rl_core/config/recipe.py, NeMo RL's knobs): the LM head always
stays BF16 (as do embeddings, norms and attention, which are not linear layers), and optionally the
first / last N transformer blocks keep all their linears in BF16.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fp8rl_core.fp8 import convert_linear_layers
from fp8rl_core.model.llama import CausalLM

if TYPE_CHECKING:  # types only: model/ does not import the config layer; the builder hands the recipe in
    from fp8rl_core.config.recipe import Quantization, Recipe


def apply_fp8(model: CausalLM, recipe: Recipe, compute_dtype: torch.dtype | None = None) -> list[str]:
    """Swap, in place, the model's nn.Linear layers for Fp8Linear quantizing as `recipe.training`, except
    `recipe.fp8_exclusions`.

    Quantization source (`fp8.quantize_from`, fp8/linear.py): with BF16 compute and `bf16`, Q(W)
    quantizes the BF16 rounding of the weight, the copy the generation engine is refit with and
    quantizes; `master` (or FP32 compute, where the generation engine holds the FP32 master itself)
    quantizes the parameter as stored.

    Parameters are shared, not copied, so an optimizer built before or after sees the same tensors.
    Idempotent: layers that already are Fp8Linear are left alone. Returns the converted names.
    """

    quant = recipe.training
    if quant is None:
        raise ValueError(f"recipe {recipe.name!r} trains in BF16: nothing to convert to FP8")
    return convert_linear_layers(model, exclude=recipe.fp8_exclusions(model.config.num_hidden_layers),
                                 quant=quant, quantize_dtype=quantize_source(quant, compute_dtype))


def quantize_source(quant: Quantization, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype Fp8Linear rounds a weight to before Q(W) (None: as stored); see apply_fp8."""
    bf16 = compute_dtype == torch.bfloat16 and quant.quantize_from == "bf16"
    return torch.bfloat16 if bf16 else None
