"""fp8.kv_cache / fp8.kv_scale / fp8.kv_quantize_from at the config edge: invalid pairs and engines are refused
with the key and the valid values named; the keys enter the cell id only when set, for every recipe."""
from __future__ import annotations

import pytest

from fp8rl_core.config import load_run_config, recipe_of, run_config_hash
from fp8rl_core.config.schema import ConfigError


@pytest.mark.parametrize("override,key", [("fp8.kv_scale=first_forward", "fp8.kv_scale"),
                                          ("fp8.kv_scale=per_token_head", "fp8.kv_scale"),
                                          ("fp8.kv_quantize_from=compute", "fp8.kv_quantize_from")])
def test_a_scale_knob_without_an_e4m3_cache_names_the_valid_pair(override, key):
    with pytest.raises(ConfigError, match=rf"{key}: .* kv_cache is 'auto'; valid: kv_cache e4m3 with kv_scale "
                                          r"trainer \| first_forward \| per_token_head"):
        load_run_config(None, [override])


def test_unknown_values_list_the_valid_ones():
    with pytest.raises(ConfigError, match=r"fp8\.kv_cache.*auto.*e4m3"):
        load_run_config(None, ["fp8.kv_cache=fp8"])
    with pytest.raises(ConfigError, match=r"fp8\.kv_scale.*trainer.*first_forward.*per_token_head"):
        load_run_config(None, ["fp8.kv_cache=e4m3", "fp8.kv_scale=dynamic"])


def test_off_the_native_engines_is_refused():
    with pytest.raises(ConfigError, match=r"fp8\.kv_cache: 'e4m3' runs in the native generation engine only"):
        load_run_config(None, ["fp8.kv_cache=e4m3", "engines.generation=vllm"])
    with pytest.raises(ConfigError, match=r"fp8\.kv_scale: 'trainer' scales come from the native trainer"):
        load_run_config(None, ["fp8.kv_cache=e4m3", "engines.training=megatron"])
    load_run_config(None, ["fp8.kv_cache=e4m3", "fp8.kv_scale=first_forward", "engines.training=megatron"])


@pytest.mark.parametrize("recipe", ["bf16", "fp8_gen", "fp8_e2e"])
def test_the_keys_enter_the_cell_id_only_when_set_and_reach_the_recipe(recipe):
    base = load_run_config(None, [f"recipe={recipe}"])
    same = load_run_config(None, [f"recipe={recipe}", "fp8.kv_cache=auto", "fp8.kv_scale=trainer",
                                  "fp8.kv_quantize_from=bf16"])
    assert run_config_hash(base) == run_config_hash(same)
    ids = {run_config_hash(load_run_config(None, [f"recipe={recipe}", "fp8.kv_cache=e4m3", *o]))
           for o in ([], ["fp8.kv_scale=first_forward"], ["fp8.kv_scale=per_token_head"],
                     ["fp8.kv_quantize_from=compute"])}
    assert len(ids) == 4 and run_config_hash(base) not in ids
    r = recipe_of(load_run_config(None, [f"recipe={recipe}", "fp8.kv_cache=e4m3", "fp8.kv_scale=per_token_head"]))
    assert (r.kv_cache, r.kv_scale, r.kv_quantize_from) == ("e4m3", "per_token_head", "bf16")
    assert r.in_bf16().kv_cache == "auto"  # the BF16 evaluation engine keeps its cache in the dtype
