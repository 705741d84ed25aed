"""The resolved recipe (fp8rl_core/config/recipe.py): every `fp8.*` knob of the run config reaches it,
each registry entry quantizes exactly the engines it names, the kept-BF16 block rules agree with one
another, and the Fp8Linear layers apply_fp8 builds carry the recipe's knobs."""
from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from fp8rl_core.config import Fp8Spec, load_run_config, recipe_of
from fp8rl_core.config.recipe import BF16, RECIPE_KNOBS, RECIPES, Quantization, Recipe, get_recipe, resolve_recipe
from fp8rl_core.fp8.convert import is_excluded

LAYER_FIELDS = RECIPE_KNOBS  # the Recipe fields resolve_recipe copies
SCALE_KNOBS = ("power_of_two_scales", "scale_format")  # both resolve into Quantization.scale_format
# process-wide, not per engine: the run's builder pins it for every FP8 GEMM (fp8/gemm.py pin_executor,
# tests/fp8rl_core/fp8/test_gemm.py); it changes no quantization, so the recipe does not carry it
PROCESS_KNOBS = ("gemm",)
OTHER = {"format": "tensorwise", "scale_format": "pow2"}  # str knobs: a valid non-default value
QUANT_FIELDS = tuple(f.name for f in dataclasses.fields(Quantization))
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _other_value(cls: type, field: dataclasses.Field) -> typing.Any:
    """A valid value of `field` that differs from its default (so that copying it is observable)."""
    hint = typing.get_type_hints(cls)[field.name]
    if field.name in OTHER:
        return OTHER[field.name]
    if typing.get_origin(hint) is typing.Literal:
        return next(v for v in typing.get_args(hint) if v != field.default)
    if hint is bool:
        return not field.default
    if hint is int:
        return field.default + 2
    if hint is float:
        return field.default + 0.5
    raise AssertionError(f"fp8.{field.name}: no test value for type {hint!r}; extend _other_value")


def _knobs(**values) -> Fp8Spec:
    return Fp8Spec(**values)


# ---- (1) every fp8.* knob reaches the recipe ---------------------------------------------------------

def test_quantization_lives_with_the_kernels_and_the_config_re_exports_it():
    import fp8rl_core.config
    import fp8rl_core.fp8
    from fp8rl_core.fp8.quantization import Quantization as home

    assert Quantization is home is fp8rl_core.config.Quantization is fp8rl_core.fp8.Quantization
    assert home.__module__ == "fp8rl_core.fp8.quantization"


def test_every_fp8_knob_is_a_quantization_or_layer_field():
    """A new `fp8.*` key must be a Quantization field (copied into each FP8 side) or one of the Recipe's
    layer counts; anything else would be silently dropped by resolve_recipe."""
    known = QUANT_FIELDS + LAYER_FIELDS + SCALE_KNOBS + PROCESS_KNOBS
    orphans = [f.name for f in dataclasses.fields(Fp8Spec) if f.name not in known]
    assert not orphans, f"fp8.{orphans[0]} reaches no recipe field (not a Quantization field nor a layer count)"
    # and the other way: every Quantization field is a knob of the run config
    assert not [n for n in QUANT_FIELDS if n not in {f.name for f in dataclasses.fields(Fp8Spec)}]


@pytest.mark.parametrize("knob", [f.name for f in dataclasses.fields(Fp8Spec)])
def test_each_fp8_knob_is_copied_into_the_resolved_recipe(knob):
    field = next(f for f in dataclasses.fields(Fp8Spec) if f.name == knob)
    value = _other_value(Fp8Spec, field)
    recipe = resolve_recipe("fp8_e2e", _knobs(**{knob: value}))
    if knob in SCALE_KNOBS:  # power_of_two_scales true and scale_format pow2: the same resolved scales
        assert recipe.generation.scale_format == recipe.training.scale_format == "pow2"
    elif knob in QUANT_FIELDS:
        assert getattr(recipe.generation, knob) == value and getattr(recipe.training, knob) == value
    elif knob in LAYER_FIELDS:
        assert getattr(recipe, knob) == value
    elif knob in PROCESS_KNOBS:  # the same quantization, whichever executor multiplies it
        assert recipe == resolve_recipe("fp8_e2e", _knobs())
    else:
        pytest.fail(f"fp8.{knob} is neither a Quantization field nor a Recipe layer field")


def test_recipe_of_reads_the_run_configs_fp8_section():
    cfg = load_run_config(None, ["recipe=fp8_e2e", "fp8.power_of_two_scales=true", "fp8.check_finite=false",
                                 "fp8.quantize_from=master", "fp8.bf16_first_layers=1", "fp8.bf16_last_layers=2"])
    recipe = recipe_of(cfg)
    quant = Quantization(scale_format="pow2", check_finite=False, quantize_from="master")
    assert recipe == Recipe("fp8_e2e", generation=quant, training=quant, bf16_first_layers=1, bf16_last_layers=2,
                            description=RECIPES["fp8_e2e"].description)
    assert recipe_of(load_run_config(None, ["recipe=bf16", "fp8.bf16_last_layers=1"])) == dataclasses.replace(
        BF16, bf16_last_layers=1)


# ---- (2) each registry entry quantizes exactly the engines it names ------------------------------------

@pytest.mark.parametrize("name", list(RECIPES))
def test_resolve_sets_each_side_exactly_per_the_registry_entry(name):
    entry = RECIPES[name]
    assert get_recipe(name) is entry and resolve_recipe(name) is entry  # no knobs: the entry as it is
    knobs = _knobs(power_of_two_scales=True, check_finite=False, bf16_last_layers=1)
    recipe = resolve_recipe(name, knobs)
    quant = Quantization(scale_format="pow2", check_finite=False)
    assert recipe.generation == (quant if entry.fp8_generation else None)
    assert recipe.training == (quant if entry.fp8_training else None)
    assert (recipe.fp8_generation, recipe.fp8_training) == (entry.fp8_generation, entry.fp8_training)
    assert (recipe.name, recipe.description) == (entry.name, entry.description)
    assert recipe.bf16_last_layers == 1 and recipe.bf16_first_layers == 0


def test_registry_names_the_study_arms():
    assert {n: (r.fp8_generation, r.fp8_training) for n, r in RECIPES.items()} == {
        "bf16": (False, False), "fp8_gen": (True, False), "fp8_e2e": (True, True)}
    assert BF16 is RECIPES["bf16"]
    with pytest.raises(ValueError, match="unknown recipe 'fp9'; valid: bf16, fp8_gen, fp8_e2e"):
        resolve_recipe("fp9", Fp8Spec())


# ---- (3) the kept-BF16 block rules agree -----------------------------------------------------------------

@pytest.mark.parametrize("first,last,n", [
    (0, 0, 4), (1, 0, 4), (0, 1, 4), (1, 2, 4),
    (3, 3, 4),  # overlap: every block kept
    (2, 2, 4),  # first and last meet
    (9, 0, 4), (0, 9, 4), (9, 9, 3),  # N larger than the layer count
    (1, 1, 1), (0, 0, 0),
])
def test_bf16_blocks_fp8_block_and_exclusions_agree(first, last, n):
    recipe = resolve_recipe("fp8_e2e", _knobs(bf16_first_layers=first, bf16_last_layers=last))
    expected = [i for i in range(n) if i < first or i >= n - last]  # independent: the first/last N
    assert recipe.bf16_blocks(n) == expected
    assert [recipe.fp8_block(i, n) for i in range(n)] == [i not in expected for i in range(n)]
    excl = recipe.fp8_exclusions(n)
    assert excl == ("lm_head", *(f"model.layers.{i}.*" for i in expected))
    for i in range(n):  # the fnmatch patterns select exactly the kept blocks' linears
        for lin in LINEARS:
            assert is_excluded(f"model.layers.{i}.{lin}", excl) == (not recipe.fp8_block(i, n))
    assert is_excluded("lm_head", excl)


# ---- (4) in_bf16 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(RECIPES))
def test_in_bf16_keeps_the_layer_counts_and_has_no_fp8_side(name):
    recipe = resolve_recipe(name, _knobs(bf16_first_layers=1, bf16_last_layers=2, power_of_two_scales=True))
    plain = recipe.in_bf16()
    assert plain.generation is None and plain.training is None
    assert not plain.fp8_generation and not plain.fp8_training
    assert (plain.bf16_first_layers, plain.bf16_last_layers) == (1, 2)
    assert plain.bf16_blocks(6) == recipe.bf16_blocks(6) == [0, 4, 5]
    assert plain == dataclasses.replace(BF16, bf16_first_layers=1, bf16_last_layers=2)


# ---- (5) apply_fp8 builds Fp8Linear with the recipe's knobs -----------------------------------------------

@pytest.mark.parametrize("power_of_two,check_finite", [(False, True), (True, False)])
@pytest.mark.parametrize("source,compute,expected", [
    ("bf16", torch.bfloat16, torch.bfloat16), ("master", torch.bfloat16, None),
    ("bf16", torch.float32, None), ("master", torch.float32, None), ("bf16", None, None),
])
def test_apply_fp8_layers_carry_the_recipes_knobs(power_of_two, check_finite, source, compute, expected):
    from fp8rl_core.fp8 import Fp8Linear
    from fp8rl_core.model import ModelConfig, apply_fp8, build_model
    from fp8rl_core.model.fp8_policy import quantize_source

    cfg = ModelConfig(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1)
    recipe = resolve_recipe("fp8_e2e", _knobs(power_of_two_scales=power_of_two, check_finite=check_finite,
                                              quantize_from=source, bf16_last_layers=1))
    assert quantize_source(recipe.training, compute) == expected
    model = build_model(cfg)
    converted = apply_fp8(model, recipe, compute)
    assert converted == [f"model.layers.{i}.{lin}" for i in (0, 1) for lin in LINEARS]
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert sorted(layers) == sorted(converted)
    for layer in layers.values():
        assert (layer.power_of_two, layer.check_finite, layer.quantize_dtype) == (power_of_two, check_finite, expected)
