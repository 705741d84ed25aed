"""The engine study's arms: a run's recipe and the engines that ran it, and the arm's label.

    arm_of(run)            # EngineArm("bf16", "vllm", weight_only=False, training="native")
    arm_of(run).label      # "bf16 · vLLM"; "fp8_gen · vLLM W8A16"; "fp8_e2e · native"

What a run ran comes from its MLflow params (the resolved run config, flattened): `recipe` (also a tag),
`engines.generation`, `engines.training` and `engines.vllm.fp8_weight_only`. A run logged before a key
existed has no such param: it ran the default (the native engines, no weight-only FP8).

Weight-only FP8 is its own arm, never the seed's recipe: vLLM's CPU build serves FP8 linears with BF16
activations (W8A16) where the seed's fp8_gen quantizes activations too, so a vLLM run of an FP8 recipe with
`engines.vllm.fp8_weight_only: true` is labelled "<recipe> · vLLM W8A16". The knob changes nothing for a
recipe whose generation quantizes nothing (bf16): such a run is "bf16 · vLLM". A trainer other than the
native one is named after an arrow: "fp8_e2e · vLLM → Megatron-Core".

`EXPECTED_ORDER` is the fixed orientation of every pairwise ordering ("A below B"), set before any run:
BF16 before FP8, fp8_e2e before fp8_gen (claims 1–2), and within a recipe our own pair of engines (the native
generation engine) before the real inference engine (vLLM BF16 measured 1.040 on a real model against our
study's 1.0016, issue 30), weight-only last. The orientation is a hypothesis to test, not a result.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fp8rl_core.config import RECIPES
from fp8rl_core.tracking import TAG_RECIPE

GENERATION, TRAINING, WEIGHT_ONLY = "engines.generation", "engines.training", "engines.vllm.fp8_weight_only"
NATIVE, VLLM = "native", "vllm"
ENGINE_NAMES = {NATIVE: "native", VLLM: "vLLM", "megatron": "Megatron-Core"}
W8A16 = "W8A16"
SEP = " · "
# claims 1-2's order of recipes (lowest mismatch first), then the generation engines within a recipe
RECIPE_RANK = ("bf16", "fp8_e2e", "fp8_gen")
ENGINE_RANK = (NATIVE, VLLM)


def _flag(value: str | None) -> bool:
    return str(value).strip().lower() == "true"


@dataclass(frozen=True, order=False)
class EngineArm:
    recipe: str
    generation: str = NATIVE
    weight_only: bool = False  # vLLM's weight-only FP8 (W8A16) generation: only set for a recipe that quantizes
    training: str = NATIVE

    @property
    def label(self) -> str:
        gen = ENGINE_NAMES.get(self.generation, self.generation) + (f" {W8A16}" if self.weight_only else "")
        train = "" if self.training == NATIVE else " → " + ENGINE_NAMES.get(self.training, self.training)
        return f"{self.recipe}{SEP}{gen}{train}"

    @property
    def rank(self) -> tuple:
        """EXPECTED_ORDER's sort key: recipe, then generation engine, weight-only last, then the label."""
        r = RECIPE_RANK.index(self.recipe) if self.recipe in RECIPE_RANK else len(RECIPE_RANK)
        g = ENGINE_RANK.index(self.generation) if self.generation in ENGINE_RANK else len(ENGINE_RANK)
        return (r, self.recipe, g, self.weight_only, self.training != NATIVE, self.label)

    @property
    def real_engine(self) -> bool:
        """Does a real inference engine (not ours) generate?"""
        return self.generation != NATIVE


def arm_from(params: Mapping[str, str], recipe: str | None = None) -> EngineArm:
    """The arm of a run's params (missing keys: their defaults); `recipe` overrides the param (the tag)."""
    recipe = recipe or params.get(TAG_RECIPE) or "?"
    generation = (params.get(GENERATION) or NATIVE).strip()
    quantizes = recipe in RECIPES and RECIPES[recipe].fp8_generation
    weight_only = generation == VLLM and quantizes and _flag(params.get(WEIGHT_ONLY))
    return EngineArm(recipe, generation, weight_only, (params.get(TRAINING) or NATIVE).strip())


def arm_of(run) -> EngineArm:
    """The arm of an `analysis.fetch.RunHistory` (its recipe tag first, then its params)."""
    return arm_from(run.params, run.tags.get(TAG_RECIPE))


def expected_pairs(arms: list[EngineArm]) -> list[tuple[EngineArm, EngineArm]]:
    """Every unordered pair of `arms`, oriented (A, B) with A expected below B (module docstring), in that
    order: A's rank first, then B's."""
    ordered = sorted(set(arms), key=lambda a: a.rank)
    return [(a, b) for i, a in enumerate(ordered) for b in ordered[i + 1:]]
