"""Megatron-Core's parallel layout from the run config (engines.megatron), and TP-sharded weights.

Pure functions, no Megatron import (the dicts feed Megatron's own constructors in megatron_train.py,
and tests check them against the real classes on a CPU):
- `parallel_sizes`: (tensor, pipeline, data) parallel sizes; world = tp x pp x dp;
- `model_parallel_kwargs` -> `parallel_state.initialize_model_parallel(**kw)`;
- `transformer_parallel_kwargs` -> the parallel keys of `TransformerConfig(**kw)`;
- `ddp_config_kwargs` -> `DistributedDataParallelConfig(**kw)`: FP32 gradient reduction (main grads),
  the distributed optimizer flag;
- `optimizer_config_kwargs` -> `OptimizerConfig(**kw)`: AdamW of optim.*, BF16 parameters with FP32
  main parameters / gradients (Megatron's mixed precision), sharded over data-parallel ranks when
  distributed_optimizer;
- `shard_megatron_state` / `gather_megatron_state`: a full (unsharded) Megatron state dict <-> the
  shard of tensor-parallel rank r, in Megatron's layouts: column-parallel weights (linear_qkv, whose
  rows are grouped per kv group, so a rank holds whole groups; linear_fc1 = [gate; up], each half
  split; output_layer and the vocab-parallel embedding) split on rows, row-parallel ones
  (linear_proj, linear_fc2) on columns, norms replicated;
- `padded_length`: the sequence length Transformer Engine's FP8 layers need (B x T a multiple of
  engines.megatron.pad_tokens_to; NeMo RL pads to 128 for blockwise FP8).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fp8rl_core.config import MegatronSpec, OptimSpec
from fp8rl_core.model.config import ModelConfig

COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "mlp.linear_fc1.weight")
ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def parallel_sizes(spec: MegatronSpec, world_size: int, cfg: ModelConfig | None = None) -> tuple[int, int, int]:
    """(tp, pp, dp) for `world_size` ranks; ValueError naming the key when they do not divide it (or the model)."""
    tp, pp = spec.tensor_parallel_size, spec.pipeline_parallel_size
    if world_size % (tp * pp):
        raise ValueError(f"engines.megatron.tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} does not "
                         f"divide the world size {world_size}; valid: sizes whose product divides {world_size}")
    if cfg is not None:
        for what, n in (("num_key_value_heads", cfg.num_key_value_heads),
                        ("num_attention_heads", cfg.num_attention_heads),
                        ("intermediate_size", cfg.intermediate_size), ("vocab_size", cfg.vocab_size)):
            if n % tp:
                raise ValueError(f"engines.megatron.tensor_parallel_size={tp}: the model's {what} ({n}) is not a "
                                 f"multiple of it; valid: a divisor of {math.gcd(cfg.num_key_value_heads, n)}")
        if cfg.num_hidden_layers % pp:
            raise ValueError(f"engines.megatron.pipeline_parallel_size={pp}: {cfg.num_hidden_layers} layers do not "
                             "split into equal stages; valid: a divisor of num_hidden_layers")
    return tp, pp, world_size // (tp * pp)


def model_parallel_kwargs(spec: MegatronSpec) -> dict[str, Any]:
    """kwargs of megatron.core.parallel_state.initialize_model_parallel."""
    return {"tensor_model_parallel_size": spec.tensor_parallel_size,
            "pipeline_model_parallel_size": spec.pipeline_parallel_size}


def transformer_parallel_kwargs(spec: MegatronSpec) -> dict[str, Any]:
    """The parallel keys of megatron.core TransformerConfig (merged into transformer_config_kwargs');
    pipeline stages exchange BF16 activations (pipeline_dtype, required by Megatron when pp > 1)."""
    kw: dict[str, Any] = {"tensor_model_parallel_size": spec.tensor_parallel_size,
                          "pipeline_model_parallel_size": spec.pipeline_parallel_size,
                          "sequence_parallel": spec.sequence_parallel}
    if spec.pipeline_parallel_size > 1:
        kw["pipeline_dtype"] = torch.bfloat16
    return kw


def ddp_config_kwargs(spec: MegatronSpec) -> dict[str, Any]:
    """kwargs of megatron.core.distributed.DistributedDataParallelConfig: FP32 main gradients reduced
    in FP32, no overlap (the GRPO step is one backward), the distributed optimizer flag."""
    return {"grad_reduce_in_fp32": True, "overlap_grad_reduce": False, "overlap_param_gather": False,
            "use_distributed_optimizer": spec.distributed_optimizer, "check_for_nan_in_grad": True}


def optimizer_config_kwargs(optim: OptimSpec, spec: MegatronSpec) -> dict[str, Any]:
    """kwargs of megatron.core.optimizer.OptimizerConfig: our AdamW (optim.*) as Megatron's "adam"
    (decoupled weight decay), BF16 parameters with FP32 main parameters and gradients, gradient
    clipping at optim.grad_clip (0: off), sharded over data-parallel ranks when distributed_optimizer."""
    beta1, beta2 = optim.betas
    return {"optimizer": "adam", "lr": optim.lr, "min_lr": optim.lr, "weight_decay": optim.weight_decay,
            "adam_beta1": beta1, "adam_beta2": beta2, "adam_eps": optim.eps,
            "clip_grad": optim.grad_clip if optim.grad_clip > 0 else 0.0, "bf16": True,
            "params_dtype": torch.bfloat16, "use_distributed_optimizer": spec.distributed_optimizer}


def padded_length(batch: int, length: int, multiple: int) -> int:
    """The smallest T' >= length with batch x T' a multiple of `multiple` (right padding: causal attention
    leaves the real tokens unchanged; the extra positions are masked out of every loss and metric)."""
    if multiple <= 1:
        return length
    step = multiple // math.gcd(batch, multiple)
    return -(-length // step) * step


# ---- tensor-parallel shards -----------------------------------------------------------------------
def _kind(key: str) -> str:
    if key.endswith(VOCAB):
        return "vocab"
    if key.endswith("mlp.linear_fc1.weight"):
        return "fc1"
    if key.endswith(COLUMN):
        return "column"
    if key.endswith(ROW):
        return "row"
    return "replicated"


def shard_megatron_state(state: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int
                         ) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank `rank`'s shard (of `tp`) of a full Megatron GPTModel state dict (megatron_convert's
    hf_to_megatron layout). linear_qkv: contiguous row blocks = whole kv groups; linear_fc1: rank's rows of
    gate, then of up; row-parallel weights: column blocks; vocab-parallel: row blocks; the rest as is."""
    if not 0 <= rank < tp:
        raise ValueError(f"tensor-parallel rank {rank} outside [0, {tp})")
    parallel_sizes(MegatronSpec(tensor_parallel_size=tp), tp, cfg)
    out = {}
    for key, t in state.items():
        kind = _kind(key)
        if kind in ("column", "vocab"):
            out[key] = t.chunk(tp, dim=0)[rank]
        elif kind == "fc1":
            gate, up = t.chunk(2, dim=0)
            out[key] = torch.cat((gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]))
        elif kind == "row":
            out[key] = t.chunk(tp, dim=1)[rank]
        else:
            out[key] = t
    return out


def gather_megatron_state(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full state dict from every tensor-parallel rank's shard (rank order): the inverse of
    shard_megatron_state. Replicated tensors must agree across ranks (checked)."""
    tp, out = len(shards), {}
    for key in shards[0]:
        parts = [s[key] for s in shards]
        kind = _kind(key)
        if kind in ("column", "vocab"):
            out[key] = torch.cat(parts, dim=0)
        elif kind == "fc1":
            halves = [p.chunk(2, dim=0) for p in parts]
            out[key] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        elif kind == "row":
            out[key] = torch.cat(parts, dim=1)
        else:
            if any(not torch.equal(p, parts[0]) for p in parts[1:]):
                raise ValueError(f"{key}: replicated tensor differs across the {tp} tensor-parallel ranks")
            out[key] = parts[0]
    return out
