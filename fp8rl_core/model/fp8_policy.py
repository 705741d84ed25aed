"""Which of the policy model's linear layers run in blockwise FP8, per the recipe's Fp8Spec.

NeMo RL's knobs: the LM head always stays BF16 (as do embeddings, norms and attention, which are not
linear layers), and optionally the first / last N transformer blocks keep all their linears in BF16.
"""
from __future__ import annotations

import torch

from fp8rl_core.config import Fp8Spec
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.llama import CausalLM


def bf16_blocks(cfg: ModelConfig, spec: Fp8Spec) -> list[int]:
    """Indices of the transformer blocks that stay BF16: the first and the last N (may overlap)."""
    n = cfg.num_hidden_layers
    first = range(min(spec.bf16_first_layers, n))
    last = range(max(0, n - spec.bf16_last_layers), n)
    return sorted(set(first) | set(last))


def fp8_exclusions(cfg: ModelConfig, spec: Fp8Spec) -> tuple[str, ...]:
    """fnmatch patterns of module names that stay BF16: lm_head and every linear of the kept blocks."""
    return ("lm_head", *(f"model.layers.{i}.*" for i in bf16_blocks(cfg, spec)))


def apply_fp8(model: CausalLM, spec: Fp8Spec, quantize_dtype: torch.dtype | None = None) -> list[str]:
    """Swap, in place, the model's nn.Linear layers for Fp8Linear except `fp8_exclusions`.

    quantize_dtype: Q(W) quantizes the weight rounded to it (the BF16 copy both engines quantize,
    `fp8.quantize_from: bf16`); None: the parameter as stored (`master`). See fp8/linear.py.

    Parameters are shared, not copied, so an optimizer built before or after sees the same tensors.
    Idempotent: layers that already are Fp8Linear are left alone. Returns the converted names.
    """
    from fp8rl_core.fp8 import convert_linear_layers

    return convert_linear_layers(model, exclude=fp8_exclusions(model.config, spec),
                                 power_of_two=spec.power_of_two_scales, check_finite=spec.check_finite,
                                 quantize_dtype=quantize_dtype)
