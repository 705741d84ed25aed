"""Our HF Llama/Qwen2 model <-> Megatron-Core's GPTModel: config kwargs and state_dict conversion.

Pure functions, no Megatron import: the dicts they return are fed to
`megatron.core.transformer.TransformerConfig(**kw)` and `GPTModel(config, spec, **kw)` by
fp8rl_core/engines/megatron_train.py, so that the mapping is testable without megatron-core.

Shapes (H hidden, I intermediate, V vocab, n query heads, g kv groups (= HF num_key_value_heads),
d head_dim, r = n / g query heads per group):

| HF (per layer i: `model.layers.{i}.`)           | Megatron (`decoder.layers.{i}.`)                 |
| ----------------------------------------------- | ------------------------------------------------ |
| self_attn.{q,k,v}_proj.weight [n*d|g*d|g*d, H]  | self_attention.linear_qkv.weight [(n+2g)*d, H]   |
| self_attn.{q,k,v}_proj.bias (Qwen2)             | self_attention.linear_qkv.bias [(n+2g)*d]        |
| self_attn.o_proj.weight [H, n*d]                | self_attention.linear_proj.weight [H, n*d]       |
| mlp.{gate,up}_proj.weight [I, H] each           | mlp.linear_fc1.weight [2I, H] = [gate; up]       |
| mlp.down_proj.weight [H, I]                     | mlp.linear_fc2.weight [H, I]                     |
| input_layernorm.weight [H]                      | input_layernorm.weight (local spec), or          |
|                                                 | self_attention.linear_qkv.layer_norm_weight (TE) |
| post_attention_layernorm.weight [H]             | pre_mlp_layernorm.weight (local), or             |
|                                                 | mlp.linear_fc1.layer_norm_weight (TE)            |
| model.embed_tokens.weight [V, H]                | embedding.word_embeddings.weight [V, H]          |
| model.norm.weight [H]                           | decoder.final_layernorm.weight [H]               |
| lm_head.weight [V, H] (untied only)             | output_layer.weight [V, H] (absent when tied)    |

Fused QKV rows are grouped per kv group (Megatron's `get_query_key_value_tensors` splits
[.., g, (r + 2) * d]): for group j, the r query heads j*r .. j*r+r-1, then key head j, then value
head j, each d rows. Transformer Engine's fused LayerNorm+Linear modules hold the pre-attention and
pre-MLP norm weights under `layer_norm_weight`; TE also adds `_extra_state` entries (FP8 metadata),
which carry no weights and are skipped here.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from fp8rl_core.config.recipe import BF16, Recipe
from fp8rl_core.model.config import ModelConfig

FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"  # TE reads it when transformer_engine is imported
EXTRA_STATE = "_extra_state"


def as_model_config(cfg: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from itself or from an HF config.json dict (Llama or Qwen2)."""
    return cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_hf_dict(dict(cfg))


def _check_supported(cfg: ModelConfig) -> None:
    if cfg.model_type not in ("llama", "qwen2"):
        raise ValueError(f"model_type: {cfg.model_type!r} not supported by the Megatron backend; valid: llama, qwen2")
    if cfg.attention_bias and cfg.model_type == "llama":
        # HF Llama's attention_bias also biases o_proj; Megatron's only knob for that (add_bias_linear)
        # would bias the MLP too, so the architectures would differ.
        raise ValueError("attention_bias: Llama with attention_bias=True (o_proj bias) has no Megatron equivalent; "
                         "valid: false for llama, or model_type qwen2 (q/k/v bias only)")


def transformer_config_kwargs(cfg: ModelConfig | Mapping[str, Any], recipe: Recipe = BF16) -> dict[str, Any]:
    """kwargs of megatron.core TransformerConfig for our architecture and a recipe's training precision.

    Architecture: pre-norm RMSNorm (eps), SwiGLU (gated_linear_unit + silu), GQA
    (num_query_groups = num_key_value_heads, kv_channels = head_dim), no linear biases except Qwen2's
    q/k/v (add_qkv_bias), no dropout. Fused kernels (bias/activation, softmax, RoPE, persistent
    LayerNorm, gradient-accumulation fusion) are off: they need apex or TE builds, and our native
    trainer has none of them either.
    Precision: a recipe with fp8_training (fp8_e2e) -> fp8="e4m3", fp8_recipe="blockwise" (TE's
    Float8BlockScaling: [1,128] activations/gradients, [128,128] weights, FP32 scales), weights kept
    in high precision (fp8_param False) and wgrad in FP8 too; the recipe's bf16_first/last_layers map
    to first_last_layers_bf16. Other recipes train in BF16: no fp8 keys at all.
    """
    cfg = as_model_config(cfg)
    _check_supported(cfg)
    kw: dict[str, Any] = dict(
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim, normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=cfg.attention_bias,
        hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        params_dtype=torch.float32,  # FP32 master weights, BF16 compute under autocast (as the native trainer)
    )
    if recipe.fp8_training:
        kw.update(fp8="e4m3", fp8_recipe="blockwise", fp8_param=False, fp8_wgrad=True)
        if recipe.bf16_first_layers or recipe.bf16_last_layers:
            kw.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=recipe.bf16_first_layers,
                      num_layers_at_end_in_bf16=recipe.bf16_last_layers)
    return kw


def gpt_model_kwargs(cfg: ModelConfig | Mapping[str, Any]) -> dict[str, Any]:
    """kwargs of megatron.core GPTModel besides (config, transformer_layer_spec): vocabulary, RoPE, tying.

    RoPE in HF's rotate-half layout (Megatron's rotary_interleaved=False default), full head_dim
    (rotary_percent 1), base rope_theta, and the config's scaling (rope_scaling_kwargs).
    parallel_output=False: the logits come back whole [B, T, V].
    """
    cfg = as_model_config(cfg)
    _check_supported(cfg)
    base = cfg.rope_theta
    return dict(vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                position_embedding_type="rope", rotary_percent=1.0,
                rotary_base=int(base) if float(base).is_integer() else base,
                share_embeddings_and_output_weights=cfg.tie_word_embeddings, parallel_output=False,
                **rope_scaling_kwargs(cfg))


# Megatron-Core's RotaryEmbedding._apply_scaling takes only `factor`; the other llama3 parameters are fixed
MEGATRON_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_scaling_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """GPTModel's RoPE-scaling kwargs for ModelConfig.rope_scaling (model/rope.py).

    llama3 -> rope_scaling=True, rope_scaling_factor=factor (Megatron-Core implements Llama-3.1's
      formula with low/high_freq_factor 1, 4 and original length 8192 fixed: any other values are refused);
    linear -> seq_len_interpolation_factor=factor (positions / factor, the same angles as inv_freq / factor);
    plain RoPE -> {} (Megatron's defaults: no scaling).
    """
    sc = cfg.rope_scaling
    if sc is None:
        return {}
    if sc["rope_type"] == "linear":
        return {"seq_len_interpolation_factor": float(sc["factor"])}
    other = {k: sc[k] for k in MEGATRON_LLAMA3_FIXED if sc[k] != MEGATRON_LLAMA3_FIXED[k]}
    if other:
        raise ValueError(f"rope_scaling: Megatron-Core's llama3 RoPE scaling fixes {MEGATRON_LLAMA3_FIXED}; "
                         f"this config has {other}; valid: those values (Llama-3.1/3.2's), or engines.training=native")
    return {"rope_scaling": True, "rope_scaling_factor": float(sc["factor"])}


def fp8_env(recipe: Recipe) -> dict[str, str]:
    """Environment for Transformer Engine, to set before it is imported.

    FP8 training: NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1 (FP32 scales = amax / 448, as our Table 1 and
    NeMo RL), or 0 with the recipe's power_of_two_scales (TE's default: scales rounded to 2^k). BF16: {}.
    """
    if recipe.training is None:
        return {}
    return {FP32_SCALES_ENV: "0" if recipe.training.power_of_two_scales else "1"}


# ---- fused QKV / gate-up layout -------------------------------------------------------------------

def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_heads: int, n_groups: int,
             head_dim: int) -> torch.Tensor:
    """[n*d, ...], [g*d, ...], [g*d, ...] -> [(n+2g)*d, ...] in Megatron's per-group order.

    Works for weights ([rows, H]) and biases ([rows]); trailing dims pass through.
    """
    r, rest = n_heads // n_groups, q.shape[1:]
    qg = q.reshape(n_groups, r * head_dim, *rest)
    kg = k.reshape(n_groups, head_dim, *rest)
    vg = v.reshape(n_groups, head_dim, *rest)
    return torch.cat((qg, kg, vg), dim=1).reshape((n_heads + 2 * n_groups) * head_dim, *rest)


def split_qkv(qkv: torch.Tensor, n_heads: int, n_groups: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of fuse_qkv: [(n+2g)*d, ...] -> q [n*d, ...], k [g*d, ...], v [g*d, ...]."""
    r, rest = n_heads // n_groups, qkv.shape[1:]
    expected = (n_heads + 2 * n_groups) * head_dim
    if qkv.shape[0] != expected:
        raise ValueError(f"linear_qkv: {qkv.shape[0]} rows, expected (n_heads + 2 * n_groups) * head_dim = {expected}")
    g = qkv.reshape(n_groups, (r + 2) * head_dim, *rest)
    q, k, v = g.split((r * head_dim, head_dim, head_dim), dim=1)
    return (q.reshape(n_heads * head_dim, *rest), k.reshape(n_groups * head_dim, *rest),
            v.reshape(n_groups * head_dim, *rest))


# ---- state_dict conversion ------------------------------------------------------------------------

def _norm_names(i: int, te_fused_norms: bool) -> tuple[str, str]:
    p = f"decoder.layers.{i}."
    if te_fused_norms:
        return p + "self_attention.linear_qkv.layer_norm_weight", p + "mlp.linear_fc1.layer_norm_weight"
    return p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"


def expected_hf_keys(cfg: ModelConfig) -> list[str]:
    """The HF state_dict keys of the architecture (lm_head.weight included even when tied)."""
    keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        keys += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "self_attn.o_proj.weight",
                 p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
        keys += [f"{p}self_attn.{x}_proj.{t}" for x in "qkv" for t in (("weight", "bias") if cfg.attention_bias
                                                                      else ("weight",))]
    return keys


def _check_hf_keys(state: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    expected = set(expected_hf_keys(cfg))
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = sorted(expected - optional - set(state))
    unexpected = sorted(k for k in set(state) - expected if not k.endswith("rotary_emb.inv_freq"))
    if missing or unexpected:
        raise KeyError(f"HF state_dict does not match the config ({cfg.model_type}, {cfg.num_hidden_layers} layers, "
                       f"attention_bias={cfg.attention_bias}): missing {missing[:5]}, unexpected {unexpected[:5]}")


def hf_to_megatron(state: Mapping[str, torch.Tensor], cfg: ModelConfig | Mapping[str, Any], *,
                   te_fused_norms: bool = False) -> dict[str, torch.Tensor]:
    """HF-named weights (our CausalLM.state_dict()) -> Megatron GPTModel names (module table above).

    te_fused_norms: True for the Transformer Engine layer spec (norm weights inside linear_qkv /
    linear_fc1), False for the local spec. With tied embeddings lm_head.weight is dropped (Megatron
    reads the embedding). Fused tensors are new tensors; the others are the same tensors as the input.
    """
    cfg = as_model_config(cfg)
    _check_supported(cfg)
    _check_hf_keys(state, cfg)
    n, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = {"embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn_norm, mlp_norm = _norm_names(i, te_fused_norms)
        out[attn_norm] = state[h + "input_layernorm.weight"]
        out[mlp_norm] = state[h + "post_attention_layernorm.weight"]
        for t in ("weight", "bias") if cfg.attention_bias else ("weight",):
            out[m + f"self_attention.linear_qkv.{t}"] = fuse_qkv(
                *(state[f"{h}self_attn.{x}_proj.{t}"] for x in "qkv"), n, g, d)
        out[m + "self_attention.linear_proj.weight"] = state[h + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat((state[h + "mlp.gate_proj.weight"],
                                                      state[h + "mlp.up_proj.weight"]), dim=0)
        out[m + "mlp.linear_fc2.weight"] = state[h + "mlp.down_proj.weight"]
    return out


def megatron_to_hf(state: Mapping[str, Any], cfg: ModelConfig | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Megatron GPTModel state_dict (local or TE spec, detected by name) -> HF names.

    `_extra_state` entries are skipped; any other key not in the table raises KeyError. With tied
    embeddings both model.embed_tokens.weight and lm_head.weight are returned (the same tensor), as
    our CausalLM.state_dict() does. Split q/k/v and gate/up are views where slicing allows.
    """
    cfg = as_model_config(cfg)
    _check_supported(cfg)
    src = {k: v for k, v in state.items() if not k.endswith(EXTRA_STATE)}
    te = any(k.endswith("linear_qkv.layer_norm_weight") for k in src)
    n, g, d, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in src:
            raise KeyError(f"Megatron state_dict: missing {key!r} (config: {cfg.num_hidden_layers} layers, "
                           f"tied={cfg.tie_word_embeddings}, qkv bias={cfg.attention_bias})")
        used.add(key)
        return src[key]

    emb = take("embedding.word_embeddings.weight")
    out = {"model.embed_tokens.weight": emb, "model.norm.weight": take("decoder.final_layernorm.weight")}
    for i in range(cfg.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        attn_norm, mlp_norm = _norm_names(i, te)
        out[h + "input_layernorm.weight"] = take(attn_norm)
        out[h + "post_attention_layernorm.weight"] = take(mlp_norm)
        for t in ("weight", "bias") if cfg.attention_bias else ("weight",):
            q, k, v = split_qkv(take(m + f"self_attention.linear_qkv.{t}"), n, g, d)
            out.update({f"{h}self_attn.q_proj.{t}": q, f"{h}self_attn.k_proj.{t}": k, f"{h}self_attn.v_proj.{t}": v})
        out[h + "self_attn.o_proj.weight"] = take(m + "self_attention.linear_proj.weight")
        fc1 = take(m + "mlp.linear_fc1.weight")
        if fc1.shape[0] != 2 * inter:
            raise ValueError(f"{m}mlp.linear_fc1.weight: {fc1.shape[0]} rows, "
                             f"expected 2 * intermediate_size = {2 * inter}")
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = fc1[:inter], fc1[inter:]
        out[h + "mlp.down_proj.weight"] = take(m + "mlp.linear_fc2.weight")
    out["lm_head.weight"] = emb if cfg.tie_word_embeddings else take("output_layer.weight")
    if cfg.tie_word_embeddings:
        used.add("output_layer.weight")  # a stored copy of the tied head (pipeline-parallel layouts keep one)
    unexpected = sorted(set(src) - used)
    if unexpected:
        raise KeyError(f"Megatron state_dict: unexpected keys {unexpected[:5]} for this config")
    return out


def load_megatron_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy converted weights into a GPTModel; every weight must be covered (only `_extra_state` may be
    missing: it is FP8 metadata that TE rebuilds)."""
    result = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE)]
    if missing or result.unexpected_keys:
        raise KeyError(f"GPTModel.load_state_dict: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")
