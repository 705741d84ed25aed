"""The trainer's side of the recipe: swap the policy model's linear layers for blockwise FP8.

Which layers: the recipe object's rule (its `fp8_exclusions`, NeMo RL's knobs): the LM head always
stays BF16 (as do embeddings, norms and attention, which are not linear layers), and optionally the
first / last N transformer blocks keep all their linears in BF16. How they quantize: the recipe's
`training`, a `Quantization` (fp8rl_core/fp8/quantization.py, the kernels' own type). model/ reads no
config type: `apply_fp8` takes any object with the three members of `TrainingRecipe`
(fp8rl_core/config/recipe.py's `Recipe` is one) and `convert_policy` plain values.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from fp8rl_core.fp8 import convert_linear_layers
from fp8rl_core.fp8.quantization import Quantization
from fp8rl_core.model.llama import CausalLM


class TrainingRecipe(Protocol):
    """What apply_fp8 reads of a recipe: its name, the trainer's quantization and its BF16-layer rule."""

    @property
    def name(self) -> str: ...

    @property
    def training(self) -> Quantization | None: ...  # None: the recipe trains in BF16

    def fp8_exclusions(self, num_layers: int) -> tuple[str, ...]: ...  # fnmatch patterns kept BF16


def apply_fp8(model: CausalLM, recipe: TrainingRecipe, compute_dtype: torch.dtype | None = None) -> list[str]:
    """Swap, in place, the model's nn.Linear layers for Fp8Linear quantizing as `recipe.training`, except
    `recipe.fp8_exclusions`. Returns the converted names (see convert_policy)."""
    quant = recipe.training
    if quant is None:
        raise ValueError(f"recipe {recipe.name!r} trains in BF16: nothing to convert to FP8")
    return convert_policy(model, quant, exclude=recipe.fp8_exclusions(model.config.num_hidden_layers),
                          compute_dtype=compute_dtype)


def convert_policy(model: CausalLM, quant: Quantization, *, exclude: Iterable[str],
                   compute_dtype: torch.dtype | None = None) -> list[str]:
    """Swap, in place, the model's nn.Linear layers but `exclude` (fnmatch patterns) for Fp8Linear quantizing
    as `quant`.

    Quantization source (`fp8.quantize_from`, fp8/linear.py): with BF16 compute and `bf16`, Q(W)
    quantizes the BF16 rounding of the weight, the copy the generation engine is refit with and
    quantizes; `master` (or FP32 compute, where the generation engine holds the FP32 master itself)
    quantizes the parameter as stored.

    Parameters are shared, not copied, so an optimizer built before or after sees the same tensors.
    Idempotent: layers that already are Fp8Linear are left alone. Returns the converted names.
    """
    return convert_linear_layers(model, exclude=exclude, quant=quant,
                                 quantize_dtype=quantize_source(quant, compute_dtype))


def quantize_source(quant: Quantization, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype Fp8Linear rounds a weight to before Q(W) (None: as stored); see convert_policy."""
    bf16 = compute_dtype == torch.bfloat16 and quant.quantize_from == "bf16"
    return torch.bfloat16 if bf16 else None
