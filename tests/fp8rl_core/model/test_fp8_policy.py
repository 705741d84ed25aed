"""Which linears become Fp8Linear under a recipe: lm_head never, first/last-N blocks kept BF16."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8rl_core.config import Fp8Spec
from fp8rl_core.config.recipe import RECIPES, resolve_recipe
from fp8rl_core.fp8 import Fp8Linear
from fp8rl_core.model import ModelConfig, apply_fp8, build_model

CFG = ModelConfig(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=2, num_key_value_heads=1)
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def e2e(**knobs) -> object:
    return resolve_recipe("fp8_e2e", Fp8Spec(**knobs))


def test_bf16_blocks():
    n = CFG.num_hidden_layers
    assert e2e().bf16_blocks(n) == []
    assert e2e(bf16_first_layers=1, bf16_last_layers=2).bf16_blocks(n) == [0, 2, 3]
    assert e2e(bf16_first_layers=3, bf16_last_layers=3).bf16_blocks(n) == [0, 1, 2, 3]
    assert e2e(bf16_first_layers=9).bf16_blocks(n) == [0, 1, 2, 3]


def test_apply_fp8_converts_exactly_the_middle_blocks_and_shares_parameters():
    torch.manual_seed(0)
    model = build_model(CFG)
    params_before = {n: p for n, p in model.named_parameters()}
    converted = apply_fp8(model, e2e(bf16_first_layers=1, bf16_last_layers=1, power_of_two_scales=True))
    expected = [f"model.layers.{i}.{lin}" for i in (1, 2) for lin in LINEARS]
    assert converted == expected
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            assert (type(module) is Fp8Linear) == (name in expected), name
    assert all(model.get_submodule(n).power_of_two for n in expected)
    assert all(p is params_before[n] for n, p in model.named_parameters())  # optimizers keep working
    assert apply_fp8(model, e2e()) == [f"model.layers.{i}.{lin}" for i in (0, 3) for lin in LINEARS]
    assert apply_fp8(model, e2e()) == []  # idempotent; lm_head never converted
    assert type(model.lm_head) is nn.Linear


@pytest.mark.parametrize("name", ["bf16", "fp8_gen"])
def test_apply_fp8_refuses_a_recipe_that_trains_in_bf16(name):
    with pytest.raises(ValueError, match="trains in BF16"):
        apply_fp8(build_model(CFG), RECIPES[name])
