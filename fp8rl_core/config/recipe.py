"""The study's recipes: which engine runs its linear layers in blockwise FP8.

A registry, so that a new recipe is one entry and an unknown name lists the known ones.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Recipe:
    name: str
    fp8_generation: bool  # generation engine: weights [128,128] + dynamic activations [1,128] in E4M3
    fp8_training: bool  # training engine: Fp8Linear forward and backward
    description: str


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("bf16", False, False, "baseline: BF16 generation and training"),
        Recipe("fp8_gen", True, False, "candidate 1: FP8 linear layers in generation only"),
        Recipe("fp8_e2e", True, True, "final: FP8 linear layers in generation and training (fwd + bwd)"),
    )
}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"recipe: unknown recipe {name!r}; valid: {', '.join(RECIPES)}") from None
