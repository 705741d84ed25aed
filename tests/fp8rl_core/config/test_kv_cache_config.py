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


@pytest.mark.parametrize("kv_scale,why", [
    ("trainer", r"vLLM cannot take new per-layer KV scales at a refit without a patch: "
                r"BaseKVCacheMethod\.process_weights_after_loading .*deletes the k_scale / v_scale parameters"),
    ("first_forward", r".*\(calculate_kv_scales is gone\)"),
    ("per_token_head", r".*no per-token-head KV dtype .*one scale per layer")])
def test_vllm_refuses_each_kv_design_with_its_reason(kv_scale, why):
    """vLLM never runs an FP8 cache at its default 1.0 scales: the config names key, engine, reason, valid."""
    with pytest.raises(ConfigError, match=rf"fp8\.kv_cache: 'e4m3' with fp8\.kv_scale '{kv_scale}' runs in the "
                                          rf"native generation engine only; engines\.generation 'vllm' cannot: {why}.*"
                                          r"; valid: fp8\.kv_cache auto with engines\.generation vllm, or "
                                          r"engines\.generation native"):
        load_run_config(None, ["fp8.kv_cache=e4m3", f"fp8.kv_scale={kv_scale}", "engines.generation=vllm"])


def test_off_the_native_engines_is_refused():
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
