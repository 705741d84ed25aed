"""Architecture of the policy model: a Llama (RMSNorm, RoPE, SwiGLU, GQA), Qwen2 = Llama + QKV bias.

Field names follow Hugging Face's `config.json`, so a checkpoint's config maps onto this one-to-one.
RoPE scaling (`rope_scaling`: linear, llama3) is model/rope.py. `eos_token_id` is an id or a list of
ids, as in HF: Llama-3.1-Instruct lists [128001, 128008, 128009] and ends a turn with 128009, and
Qwen2.5-Instruct's turn end (151645) is only in generation_config.json; `merge_eos_ids` unions the
two files' lists and `eos_ids` is what every engine stops on.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from fp8rl_core.model.rope import normalize_rope_scaling


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
    # None: plain RoPE; else {rope_type: linear | llama3, ...} (model/rope.py), HF's rope_scaling
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    model_type: str = "llama"  # "llama" | "qwen2"
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2  # one id, or every id that ends a sequence (HF allows both)
    pad_token_id: int | None = 0

    def __post_init__(self) -> None:
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling)
        if isinstance(self.eos_token_id, (list, tuple)):
            ids = [int(i) for i in self.eos_token_id]
            self.eos_token_id = ids if len(ids) > 1 else (ids[0] if ids else None)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every token id that ends a sequence (the first one is the tokenizer's EOS); () for none."""
        e = self.eos_token_id
        return () if e is None else (tuple(e) if isinstance(e, list) else (int(e),))

    @property
    def pad_id(self) -> int:
        """The padding id: pad_token_id, else the first EOS, else 0."""
        return self.pad_token_id if self.pad_token_id is not None else (self.eos_ids or (0,))[0]

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Map an HF config.json dict (Llama or Qwen2) onto ModelConfig, ignoring unknown keys."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        if data.get("model_type") == "qwen2" and "attention_bias" not in data:
            kw["attention_bias"] = True
        # transformers >= 5 writes `rope_parameters: {rope_theta, rope_type, <scaling keys>}` instead of
        # `rope_theta` + `rope_scaling` (Llama-3.1's own config.json has the latter).
        key = "rope_parameters" if data.get("rope_parameters") else "rope_scaling"
        rope = data.get(key) or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{key}: expected a mapping, got {type(rope).__name__}")
        if "rope_theta" not in data and "rope_theta" in rope:
            kw["rope_theta"] = rope["rope_theta"]
        kw["rope_scaling"] = normalize_rope_scaling(rope, where=key)
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["rope_scaling"] is None:
            d.pop("rope_scaling")  # plain RoPE: rope_theta alone, as HF writes it
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
        d.update(architectures=[arch], hidden_act="silu", torch_dtype="bfloat16", mlp_bias=False,
                 attention_dropout=0.0, initializer_range=0.02, use_cache=True)
        if self.model_type == "qwen2":
            d.pop("attention_bias")  # Qwen2 always has QKV bias; its config has no such key
        return d


def eos_id_list(*sources: Any) -> list[int]:
    """The union, in order of first appearance, of the `eos_token_id` values (an id, a list, or None) of
    several config dicts (config.json, generation_config.json) or bare values."""
    ids: list[int] = []
    for src in sources:
        value = src.get("eos_token_id") if isinstance(src, dict) else src
        for i in value if isinstance(value, (list, tuple)) else ([] if value is None else [value]):
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def merge_eos_ids(*sources: Any) -> int | list[int] | None:
    """eos_id_list as HF writes `eos_token_id`: an int when there is only one, None when there is none."""
    ids = eos_id_list(*sources)
    return ids if len(ids) > 1 else (ids[0] if ids else None)


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
