"""block128 (the package's original format, DeepSeek-V3 / vLLM block FP8) through the registry's interface.

The numerics live in quant.py / kernels.py / fused_cpu.c and the GEMM executors in gemm.py; Fp8Linear and
fp8_linear run them directly (functional.py's `quantize_weight` / `fp8_linear`, with their fused CPU fast
paths and the Hopper scaled_mm executor). This module only offers the same quantizations as lowp.QTensors
(body = the dequantized copy, no per-tensor scale), so that the generic emulation (lowp.py) can run
block128 too: it equals the "emulated" executor bit for bit (tested).
    weights [128,128] (fprop and dgrad), X and dY [1,128] along the reduction dim, wgrad operands [128,1]
"""
from __future__ import annotations

import torch

from fp8rl_core.fp8.lowp import QTensor
from fp8rl_core.fp8.quant import quantize_2d

__all__ = ["ACT_BLOCK", "WEIGHT_BLOCK", "COL_BLOCK", "quantize_operand", "quantize_weight"]

ACT_BLOCK, WEIGHT_BLOCK, COL_BLOCK = (1, 128), (128, 128), (128, 1)


def _op(x2: torch.Tensor, block: tuple[int, int], scale_format: str, check_finite: bool, name: str) -> QTensor:
    q, scale, deq = quantize_2d(x2, block, power_of_two=scale_format == "pow2", check_finite=check_finite,
                                name=name, want_dequant=True)
    return QTensor(deq, None, (q, scale, block))


def quantize_operand(x2: torch.Tensor, along: int, *, scale_format: str, check_finite: bool, name: str) -> QTensor:
    return _op(x2, ACT_BLOCK if along == 1 else COL_BLOCK, scale_format, check_finite, name)


def quantize_weight(w2: torch.Tensor, *, scale_format: str, check_finite: bool, name: str, dgrad: bool
                    ) -> tuple[QTensor, QTensor | None]:
    op = _op(w2, WEIGHT_BLOCK, scale_format, check_finite, name)
    return op, (op if dgrad else None)
