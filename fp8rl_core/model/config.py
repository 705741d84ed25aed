"""Architecture of the policy model: a Llama (RMSNorm, RoPE, SwiGLU, GQA), Qwen2 = Llama + QKV bias.

Field names follow Hugging Face's `config.json`, so a checkpoint's config maps onto this one-to-one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class ModelConfig:
    vocab_size: int = 32
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    model_type: str = "llama"  # "llama" | "qwen2"
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    pad_token_id: int | None = 0

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Map an HF config.json dict (Llama or Qwen2) onto ModelConfig, ignoring unknown keys."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        if data.get("model_type") == "qwen2" and "attention_bias" not in data:
            kw["attention_bias"] = True
        # transformers >= 5 writes `rope_parameters: {rope_theta, rope_type}` instead of `rope_theta`;
        # older configs may carry `rope_scaling`. Only plain RoPE is implemented by our engines.
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if "rope_theta" not in data and "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_parameters.rope_type: {rope_type!r} is not supported; valid: default")
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        d = asdict(self)
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        d.update(architectures=[arch], hidden_act="silu", torch_dtype="bfloat16", mlp_bias=False,
                 attention_dropout=0.0, initializer_range=0.02, use_cache=True)
        if self.model_type == "qwen2":
            d.pop("attention_bias")  # Qwen2 always has QKV bias; its config has no such key
        return d


# Tiny presets: hidden >= 256 so that the [128, 128] weight blocks tile real matrices.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),  # 4 layers, hidden 256, ~3.2 M parameters
    "small": ModelConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {name!r}; valid: {', '.join(PRESETS)}")
    return ModelConfig(**{**asdict(PRESETS[name]), **overrides})
