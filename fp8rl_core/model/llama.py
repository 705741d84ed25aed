"""The policy model: a Llama-architecture decoder (Qwen2 = Llama + q/k/v bias) with HF's module names.

`CausalLM(cfg)(input_ids [B, T], attention_mask [B, T] | None) -> logits [B, T, V]`, in the dtype
of its parameters (run it under `torch.autocast` for BF16 compute on FP32 master weights); padding-free,
`(ids [1, N], packed=pack(attention_mask))` -> logits [1, N, V] of the real tokens only (model/packing.py).
Its state_dict keys equal Hugging Face's (`model.layers.{i}.self_attn.q_proj.weight`, ...), so a
checkpoint loads by name; with tied embeddings `lm_head.weight` is the embedding parameter itself.
"""
from __future__ import annotations

import torch
from torch import nn

from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.layers import DecoderLayer, RMSNorm
from fp8rl_core.model.packing import Packed

INIT_STD = 0.02  # HF's initializer_range default for Llama/Qwen2


class Backbone(nn.Module):
    """HF's `LlamaModel`: embeddings, decoder blocks, final norm (the `model.` prefix of every key)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                packed: Packed | None = None) -> torch.Tensor:
        if packed is None:
            positions, mask = positions_and_mask(input_ids, attention_mask)
        else:  # the real tokens of a batch in one row [1, N]: attention per sequence (model/packing.py)
            positions, mask = packed.positions[None], None
        x = self.embed_tokens(input_ids)
        if torch.is_autocast_enabled(x.device.type):
            # autocast leaves embeddings in FP32; the residual stream of a BF16 trainer is BF16
            x = x.to(torch.get_autocast_dtype(x.device.type))
        for layer in self.layers:
            x = layer(x, positions, mask, packed)
        return self.norm(x)


class CausalLM(nn.Module):
    """HF's `LlamaForCausalLM` / `Qwen2ForCausalLM`: backbone + LM head (tied to the embedding or not)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type: {cfg.model_type!r} not supported; valid: llama, qwen2")
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make lm_head.weight the embedding parameter when the config ties them (no-op otherwise)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                packed: Packed | None = None) -> torch.Tensor:
        """input_ids Long[B, T], attention_mask [B, T] (1 = real token) -> logits [B, T, V].

        Logits at padding positions are computed but meaningless; callers mask them out.
        Padding-free (model/packing.py): input_ids Long[1, N] = the real tokens `packed.take(ids)[None]`
        of a padded batch, attention_mask None -> logits [1, N, V] of those tokens only.
        """
        if packed is not None and (attention_mask is not None or input_ids.shape != (1, packed.num_tokens)):
            raise ValueError(f"packed: input_ids must be the batch's {packed.num_tokens} real tokens as [1, N] "
                             f"with attention_mask None; got {tuple(input_ids.shape)}")
        return self.lm_head(self.model(input_ids, attention_mask, packed))


def positions_and_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE positions Long[B, T] and an SDPA mask (None = plain causal) for a batch.

    Right padding (each row: real tokens, then padding) needs no mask: causal attention never lets
    a real token see a later pad, so we keep SDPA's `is_causal` path (the training-engine kernel).
    Any other layout (left padding, holes) gets an explicit Bool[B, 1, T, T] mask = causal AND key is
    real, plus the diagonal so that a pad query still attends to something (no NaN rows);
    positions then count real tokens only (cumsum - 1), as HF does for left padding.
    """
    b, t = input_ids.shape
    arange = torch.arange(t, device=input_ids.device)
    if attention_mask is None:
        return arange.expand(b, t), None
    real = attention_mask.bool()
    if t < 2 or bool((real[:, 1:] <= real[:, :-1]).all()):
        return arange.expand(b, t), None
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    causal = arange[None, :] <= arange[:, None]  # [T(query), T(key)]
    mask = (causal[None] & real[:, None, :]) | torch.eye(t, dtype=torch.bool, device=input_ids.device)
    return positions, mask[:, None]


def init_weights(model: CausalLM, std: float = INIT_STD) -> None:
    """HF's init: N(0, std) for linear and embedding weights, zero biases, unit norm weights."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


def build_model(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                device: torch.device | str | None = None) -> CausalLM:
    """A randomly initialised model (drawn from the caller's torch RNG, so seed it first)."""
    model = CausalLM(cfg)
    init_weights(model)
    return model.to(device=device, dtype=dtype)
