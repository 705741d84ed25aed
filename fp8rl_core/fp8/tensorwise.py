"""Tensorwise FP8: E4M3 with one FP32 scale per tensor (NeMo RL's per-tensor option; current scaling).

    scale = amax(|x|) / 448 in FP32 (1.0 for an all-zero tensor; never below 2^-126), computed per call
            from the tensor at hand; scale_format "pow2" rounds it up to 2^k exactly as block128's
            power_of_two does (the same kernel: kernels.block_scales on a single block)
    q     = E4M3(clamp(x / scale, +-448)), FP32 division, ties to even;   x ~= q * scale

Every GEMM operand is quantized per tensor: X and dY once per use (the re-quantization for wgrad gives the
same bits as the fprop/dgrad ones, as one scale covers the tensor either way), each weight per projection.
GEMM (lowp.py): exact E4M3 products, FP32 accumulation, C * fl(scale_a * scale_b) once (cuBLAS's alpha).
Fused generation weights: each projection (q, k, v / gate, up) keeps its own tensor scale (what the trainer's
per-projection Fp8Linear computes; vLLM's online FP8 instead requantizes the fused tensor to one scale).
"""
from __future__ import annotations

import torch

from fp8rl_core.fp8.kernels import quantize_blocks
from fp8rl_core.fp8.lowp import QTensor, check_input, raise_non_finite

__all__ = ["quantize_tensorwise", "dequantize_tensorwise", "quantize_operand", "quantize_weight"]


def _quantize(x: torch.Tensor, power_of_two: bool, check_finite: bool, name: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape) -> (q E4M3 like x, scale FP32 0-d)."""
    x = check_input(x, name)
    flat = x.reshape(1, 1, 1, -1) if x.numel() else x.new_zeros(1, 1, 1, 1)
    q, scale, _ = quantize_blocks(flat, power_of_two, False)
    if check_finite and not bool(torch.isfinite(scale).all()):
        raise_non_finite(name, tuple(x.shape))
    return q.reshape(x.shape) if x.numel() else q.new_empty(x.shape), scale.reshape(())


def quantize_tensorwise(x: torch.Tensor, *, power_of_two: bool = False, check_finite: bool = True,
                        name: str = "x") -> tuple[torch.Tensor, torch.Tensor]:
    """x [...] fp32/bf16/fp16 -> (q float8_e4m3fn of x's shape, scale FP32 0-d); see the module docstring."""
    return _quantize(x, power_of_two, check_finite, name)


def dequantize_tensorwise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q.float() * scale in FP32."""
    return q.float() * scale.float()


def quantize_operand(x2: torch.Tensor, along: int, *, scale_format: str, check_finite: bool, name: str) -> QTensor:
    """One scale for the whole operand, whichever dim the GEMM contracts."""
    q, scale = _quantize(x2, scale_format == "pow2", check_finite, name)
    return QTensor(q.float(), scale, (q, scale))


def quantize_weight(w2: torch.Tensor, *, scale_format: str, check_finite: bool, name: str, dgrad: bool
                    ) -> tuple[QTensor, QTensor | None]:
    op = quantize_operand(w2, 1, scale_format=scale_format, check_finite=check_finite, name=name)
    return op, (op if dgrad else None)
