"""megatron_convert: config mapping, HF <-> Megatron weight round trips, and the fused QKV / gate-up
layouts checked against rows written out by hand (not produced by the code under test)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from fp8rl_core.config import Fp8Spec
from fp8rl_core.config.recipe import RECIPES, resolve_recipe
from fp8rl_core.engines.megatron_convert import (
    FP32_SCALES_ENV,
    expected_hf_keys,
    fp8_env,
    fuse_qkv,
    gpt_model_kwargs,
    hf_to_megatron,
    megatron_to_hf,
    split_qkv,
    transformer_config_kwargs,
)
from fp8rl_core.model import ModelConfig

LLAMA = ModelConfig(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=500000.0,
                    max_position_embeddings=128)
QWEN2_HF = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 40, "hidden_size": 48,
            "intermediate_size": 80, "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": True, "hidden_act": "silu"}
QWEN2 = ModelConfig.from_hf_dict(QWEN2_HF)


def random_hf_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of every HF key with the HF shapes (written from the HF layout, not our code)."""
    g = torch.Generator().manual_seed(seed)
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    n, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    shapes = {"q_proj.weight": (n * d, h), "k_proj.weight": (kv * d, h), "v_proj.weight": (kv * d, h),
              "q_proj.bias": (n * d,), "k_proj.bias": (kv * d,), "v_proj.bias": (kv * d,), "o_proj.weight": (h, n * d),
              "gate_proj.weight": (i, h), "up_proj.weight": (i, h), "down_proj.weight": (h, i),
              "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    out = {}
    for key in expected_hf_keys(cfg):
        leaf = ".".join(key.split(".")[-2:])
        shape = shapes.get(leaf, (cfg.vocab_size, h) if "embed" in key or "lm_head" in key else (h,))
        out[key] = torch.randn(shape, generator=g)
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ---- config mapping ---------------------------------------------------------------------------------

def test_llama_config_maps_to_transformer_config_fields():
    kw = transformer_config_kwargs(LLAMA)
    expected = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
                    kv_channels=16, normalization="RMSNorm", layernorm_epsilon=1e-6, gated_linear_unit=True,
                    add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                    params_dtype=torch.float32)
    assert {k: kw[k] for k in expected} == expected
    assert kw["activation_func"] is F.silu
    assert "fp8" not in kw and "fp8_recipe" not in kw
    gm = gpt_model_kwargs(LLAMA)
    assert gm == dict(vocab_size=48, max_sequence_length=128, position_embedding_type="rope", rotary_percent=1.0,
                      rotary_base=500000, share_embeddings_and_output_weights=False, parallel_output=False)


def test_qwen2_hf_dict_maps_bias_and_tied_embeddings():
    kw = transformer_config_kwargs(QWEN2_HF)  # straight from a config.json dict
    assert (kw["add_qkv_bias"], kw["add_bias_linear"]) == (True, False)
    assert (kw["num_attention_heads"], kw["num_query_groups"], kw["kv_channels"]) == (6, 2, 8)
    assert kw["layernorm_epsilon"] == 1e-5
    gm = gpt_model_kwargs(QWEN2_HF)
    assert gm["share_embeddings_and_output_weights"] is True and gm["rotary_base"] == 1000000


@pytest.mark.parametrize("recipe", ["bf16", "fp8_gen"])
def test_recipes_without_fp8_training_set_no_fp8(recipe):
    assert "fp8" not in transformer_config_kwargs(LLAMA, RECIPES[recipe])
    assert fp8_env(RECIPES[recipe]) == {}


def test_fp8_e2e_maps_to_te_blockwise_with_fp32_scales():
    kw = transformer_config_kwargs(LLAMA, RECIPES["fp8_e2e"])
    assert (kw["fp8"], kw["fp8_recipe"], kw["fp8_param"], kw["fp8_wgrad"]) == ("e4m3", "blockwise", False, True)
    assert "first_last_layers_bf16" not in kw
    assert fp8_env(RECIPES["fp8_e2e"]) == {FP32_SCALES_ENV: "1"}
    assert fp8_env(resolve_recipe("fp8_e2e", Fp8Spec(power_of_two_scales=True))) == {FP32_SCALES_ENV: "0"}
    kw = transformer_config_kwargs(LLAMA, resolve_recipe("fp8_e2e", Fp8Spec(bf16_first_layers=1, bf16_last_layers=0)))
    assert (kw["first_last_layers_bf16"], kw["num_layers_at_start_in_bf16"], kw["num_layers_at_end_in_bf16"]) == (
        True, 1, 0)


def test_real_transformer_config_accepts_the_kwargs():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.transformer_config import TransformerConfig

        kept_last = resolve_recipe("fp8_e2e", Fp8Spec(bf16_last_layers=1))
        c = TransformerConfig(**transformer_config_kwargs(QWEN2, kept_last))
        bf16 = TransformerConfig(**transformer_config_kwargs(LLAMA, RECIPES["bf16"]))
    assert (c.num_layers, c.hidden_size, c.ffn_hidden_size, c.num_query_groups, c.kv_channels) == (3, 48, 80, 2, 8)
    assert (c.normalization, c.gated_linear_unit, c.add_qkv_bias, c.add_bias_linear) == ("RMSNorm", True, True, False)
    fp8 = (c.fp8, c.fp8_recipe, c.first_last_layers_bf16, c.num_layers_at_end_in_bf16)
    assert fp8 == ("e4m3", "blockwise", True, 1)
    assert bf16.fp8 is None


def test_llama_with_o_proj_bias_is_refused():
    with pytest.raises(ValueError, match="attention_bias"):
        transformer_config_kwargs(ModelConfig(attention_bias=True))


# ---- fused layouts, by hand -------------------------------------------------------------------------

def test_fused_qkv_rows_follow_megatron_group_order_by_hand():
    """4 query heads, 2 kv groups, head_dim 2: row value = 100*kind + 10*head + dim (kind 1=q, 2=k, 3=v).

    Megatron's per-group order is [q heads of the group, k of the group, v of the group]:
    group 0 = q0 q1 k0 v0, group 1 = q2 q3 k1 v1 (written out below by hand)."""
    n, g, d = 4, 2, 2
    q = torch.tensor([[100.0 + 10 * hd + j] for hd in range(n) for j in range(d)])
    k = torch.tensor([[200.0 + 10 * hd + j] for hd in range(g) for j in range(d)])
    v = torch.tensor([[300.0 + 10 * hd + j] for hd in range(g) for j in range(d)])
    expected = [100, 101, 110, 111, 200, 201, 300, 301,   # group 0: q0 q1 k0 v0
                120, 121, 130, 131, 210, 211, 310, 311]   # group 1: q2 q3 k1 v1
    fused = fuse_qkv(q, k, v, n, g, d)
    assert fused[:, 0].tolist() == expected
    bias = fuse_qkv(q[:, 0], k[:, 0], v[:, 0], n, g, d)  # 1-D biases take the same path
    assert bias.tolist() == expected
    q2, k2, v2 = split_qkv(fused, n, g, d)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_fc1_is_gate_then_up_and_norms_land_by_name():
    cfg = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=3, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    hf = random_hf_state(cfg)
    mg = hf_to_megatron(hf, cfg)
    fc1 = mg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.shape == (6, 4)
    assert torch.equal(fc1[:3], hf["model.layers.0.mlp.gate_proj.weight"])  # Megatron's glu: silu(first half)
    assert torch.equal(fc1[3:], hf["model.layers.0.mlp.up_proj.weight"])
    assert mg["decoder.layers.0.input_layernorm.weight"] is hf["model.layers.0.input_layernorm.weight"]
    assert mg["decoder.layers.0.pre_mlp_layernorm.weight"] is hf["model.layers.0.post_attention_layernorm.weight"]
    te = hf_to_megatron(hf, cfg, te_fused_norms=True)
    layer = "model.layers.0."
    assert te["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] is hf[layer + "input_layernorm.weight"]
    assert te["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] is hf[layer + "post_attention_layernorm.weight"]


# ---- round trips -------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg", [LLAMA, QWEN2], ids=["llama-gqa", "qwen2-bias-tied"])
@pytest.mark.parametrize("te", [False, True], ids=["local", "te"])
def test_round_trip_is_bit_exact(cfg, te):
    hf = random_hf_state(cfg)
    mg = hf_to_megatron(hf, cfg, te_fused_norms=te)
    n_linear_qkv = cfg.num_hidden_layers * (2 if cfg.attention_bias else 1)
    assert sum(k.endswith(("linear_qkv.weight", "linear_qkv.bias")) for k in mg) == n_linear_qkv
    assert ("output_layer.weight" in mg) == (not cfg.tie_word_embeddings)
    qkv = mg["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, cfg.hidden_size)
    # TE adds FP8 metadata entries that carry no weights: they must be ignored
    mg = {**mg, "decoder.layers.0.mlp.linear_fc2._extra_state": None}
    back = megatron_to_hf(mg, cfg)
    assert sorted(back) == sorted(hf)
    for key, t in hf.items():
        assert back[key].shape == t.shape and torch.equal(back[key], t), key


def test_conversion_errors_name_the_key():
    hf = random_hf_state(LLAMA)
    with pytest.raises(KeyError, match="missing.*o_proj"):
        hf_to_megatron({k: v for k, v in hf.items() if "layers.1.self_attn.o_proj" not in k}, LLAMA)
    with pytest.raises(KeyError, match="unexpected.*extra_weight"):
        hf_to_megatron({**hf, "model.extra_weight": torch.zeros(1)}, LLAMA)
    mg = hf_to_megatron(hf, LLAMA)
    with pytest.raises(KeyError, match="decoder.layers.1.mlp.linear_fc2.weight"):
        megatron_to_hf({k: v for k, v in mg.items() if k != "decoder.layers.1.mlp.linear_fc2.weight"}, LLAMA)
    with pytest.raises(KeyError, match="unexpected.*stray"):
        megatron_to_hf({**mg, "decoder.stray.weight": torch.zeros(1)}, LLAMA)
    with pytest.raises(ValueError, match="linear_qkv"):
        split_qkv(torch.zeros(10, 4), 4, 2, 2)
