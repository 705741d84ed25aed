"""RoPE scaling (model/rope.py): transformers is the peer (its ROPE_INIT_FUNCTIONS and LlamaForCausalLM).

Tolerances: inverse frequencies bitwise equal to transformers' (same FP32 operations); logits of the
training-style model in float64 within 1e-9 relative max-norm of transformers' float64 Llama (the
cos/sin are FP32 on both sides, bitwise equal; the rest is float64 arithmetic in a different order);
the generation engine's float32 prefill within 1e-4 (float32 GEMM blocking).
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fp8rl_core.engines.megatron_convert import gpt_model_kwargs, rope_scaling_kwargs
from fp8rl_core.model import ModelConfig, build_model, load_pretrained, save_pretrained
from fp8rl_core.model.rope import inv_freq, normalize_rope_scaling

# original context 64, head_dim 32, theta 5e5: every llama3 regime (kept, interpolated, divided) is used
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 4.0}
CFG = dict(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=128, rope_theta=500000.0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def hf_config(scaling: dict | None) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**CFG, rope_scaling=dict(scaling) if scaling else None)


@pytest.mark.parametrize("scaling", [None, LINEAR, LLAMA3], ids=["default", "linear", "llama3"])
def test_inv_freq_is_bitwise_transformers(scaling):
    hf = hf_config(scaling)
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        theirs = 1.0 / (CFG["rope_theta"] ** (torch.arange(0, 32, 2, dtype=torch.int64).float() / 32))
    else:
        theirs, attention = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
        assert attention == 1.0
    ours = inv_freq(32, CFG["rope_theta"], normalize_rope_scaling(scaling))
    assert ours.dtype == torch.float32 and torch.equal(ours, theirs)
    if kind == "llama3":  # the test exercises all three regimes
        base = inv_freq(32, CFG["rope_theta"], None)
        ratio = base / ours
        assert (ratio == 1).any() and (ratio == 8).any() and ((ratio > 1) & (ratio < 8)).any()


def _pair(scaling: dict | None, dtype: torch.dtype = torch.float64):
    torch.manual_seed(0)
    ours = build_model(ModelConfig(**CFG, rope_scaling=scaling), dtype=dtype).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.add_(torch.randn_like(p) * (0.3 if "norm" in name else 0.05))
    ref = transformers.LlamaForCausalLM(hf_config(scaling)).to(dtype).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_logits_match_transformers_llama_with_scaling(scaling):
    ours, ref = _pair(scaling)
    x = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mine, theirs = ours(x), ref(x).logits
        plain = build_model(ModelConfig(**CFG), dtype=torch.float64).eval()
        plain.load_state_dict(ours.state_dict())
        unscaled = plain(x)
    assert rel_err(mine, theirs) <= 1e-9
    assert rel_err(unscaled, theirs) > 1e-3  # the scaling matters at these lengths: the test has teeth


def test_generation_engine_prefill_matches_transformers_with_llama3():
    from fp8rl_core.engines.native_gen import NativeGenerationEngine

    ours, ref = _pair(LLAMA3, torch.float32)
    engine = NativeGenerationEngine(ours.config, dtype=torch.float32)
    engine.refit(ours.state_dict())
    x = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(engine.logits(x), ref(x).logits) <= 1e-4


def test_config_json_keeps_the_scaling_for_vllm_and_transformers(tmp_path):
    ours, _ = _pair(LLAMA3, torch.float32)
    save_pretrained(ours, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["rope_scaling"] == LLAMA3 and hf["rope_theta"] == CFG["rope_theta"]  # Llama-3.1's own layout
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert {k: theirs.rope_parameters[k] for k in LLAMA3} == LLAMA3
    assert load_pretrained(tmp_path).config.rope_scaling == LLAMA3
    plain = build_model(ModelConfig(**CFG))
    save_pretrained(plain, tmp_path / "plain")
    assert "rope_scaling" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_from_hf_dict_reads_both_layouts():
    legacy = ModelConfig.from_hf_dict({**CFG, "rope_scaling": {**LLAMA3, "type": "llama3"}})
    v5 = ModelConfig.from_hf_dict({k: v for k, v in CFG.items() if k != "rope_theta"}
                                  | {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}})
    assert legacy.rope_scaling == v5.rope_scaling == LLAMA3 and v5.rope_theta == 5e5
    assert ModelConfig.from_hf_dict({**CFG, "rope_parameters": {"rope_type": "default"}}).rope_scaling is None


@pytest.mark.parametrize("scaling, fragment", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"rope_scaling.rope_type: 'dynamic' .*sequence length"),
    ({"rope_type": "yarn", "factor": 4.0}, r"rope_scaling.rope_type: 'yarn'.*valid: default, linear, llama3"),
    ({"rope_type": "su"}, r"rope_type: 'su' is not supported; valid: default, linear, llama3"),
    ({"rope_type": "llama3", "factor": 8.0}, r"rope_scaling.low_freq_factor: required for rope_type 'llama3'"),
    ({"rope_type": "linear", "factor": -1}, r"rope_scaling.factor: must be a number > 0"),
    ({**LLAMA3, "high_freq_factor": 1.0}, r"high_freq_factor: must be > low_freq_factor"),
    ({"rope_type": "linear", "factor": 2.0, "beta": 1}, r"unknown keys \['beta'\].*valid: rope_type, factor"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, r"partial_rotary_factor"),
    ("llama3", r"rope_scaling: expected a mapping"),
])
def test_bad_scaling_names_the_key_and_what_is_allowed(scaling, fragment):
    with pytest.raises(ValueError, match=fragment):
        ModelConfig(**CFG, rope_scaling=scaling)


def test_megatron_gets_the_scaling():
    llama31 = {**LLAMA3, "original_max_position_embeddings": 8192}
    kw = gpt_model_kwargs(ModelConfig(**CFG, rope_scaling=llama31))
    assert kw["rope_scaling"] is True and kw["rope_scaling_factor"] == 8.0
    assert rope_scaling_kwargs(ModelConfig(**CFG, rope_scaling=LINEAR)) == {"seq_len_interpolation_factor": 4.0}
    assert "rope_scaling" not in gpt_model_kwargs(ModelConfig(**CFG))
    with pytest.raises(ValueError, match="original_max_position_embeddings.*64"):
        rope_scaling_kwargs(ModelConfig(**CFG, rope_scaling=LLAMA3))  # Megatron fixes 8192


def test_megatron_rotary_embedding_has_our_frequencies():
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    llama31 = {**LLAMA3, "original_max_position_embeddings": 8192}
    kw = rope_scaling_kwargs(ModelConfig(**CFG, rope_scaling=llama31))
    rope = RotaryEmbedding(kv_channels=128, rotary_percent=1.0, rotary_base=500000, use_cpu_initialization=True,
                           rope_scaling=kw["rope_scaling"], rope_scaling_factor=kw["rope_scaling_factor"])
    ours = inv_freq(128, 500000.0, normalize_rope_scaling(llama31))
    assert rel_err(rope.inv_freq, ours) <= 1e-6
