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


def apply_fp8(model: CausalLM, spec: Fp8Spec, compute_dtype: torch.dtype | None = None) -> list[str]:
    """Swap, in place, the model's nn.Linear layers for Fp8Linear except `fp8_exclusions`.

    Quantization source (`fp8.quantize_from`, fp8/linear.py): with BF16 compute and `bf16`, Q(W)
    quantizes the BF16 rounding of the weight, the copy the generation engine is refit with and
    quantizes; `master` (or FP32 compute, where the generation engine holds the FP32 master itself)
    quantizes the parameter as stored.

    Parameters are shared, not copied, so an optimizer built before or after sees the same tensors.
    Idempotent: layers that already are Fp8Linear are left alone. Returns the converted names.
    """
    from fp8rl_core.fp8 import convert_linear_layers

    return convert_linear_layers(model, exclude=fp8_exclusions(model.config, spec),
                                 power_of_two=spec.power_of_two_scales, check_finite=spec.check_finite,
                                 quantize_dtype=quantize_source(spec, compute_dtype))


def quantize_source(spec: Fp8Spec, compute_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype Fp8Linear rounds a weight to before Q(W) (None: as stored); see apply_fp8."""
    bf16 = compute_dtype == torch.bfloat16 and spec.quantize_from == "bf16"
    return torch.bfloat16 if bf16 else None
