"""`Operand`: one blockwise-E4M3 GEMM operand, carried between the quantizer and the executors."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp8rl_core.fp8.quant import dequantize_2d


@dataclass(frozen=True)
class Operand:
    """A [R, K] GEMM operand quantized along K: q E4M3 [R, K], scale FP32 [ceil(R/br), ceil(K/bk)].

    deq, when the quantizer already produced it, is the FP32 dequantized copy q * scale [R, K]
    (the emulated executor's input; computing it inside the quantizer's pass saves a float8 decode).
    q is None for an activation quantized for the emulated executor, which reads deq only.
    cache: where an executor keeps layouts it derives from this value (a weight's: Fp8Weight.kernel_cache,
    so that cpu_gemm packs W and W^T once per quantization); the transposed view shares it, and the
    executor keys its entries by shape and strides. None: nothing is kept (activations, gradients).
    """

    q: torch.Tensor | None
    scale: torch.Tensor
    block: tuple[int, int]
    deq: torch.Tensor | None = None
    cache: dict | None = field(default=None, repr=False, compare=False)

    def t(self) -> Operand:
        """The transposed operand (views, no copies): [K, R] with the block grid transposed."""
        deq = None if self.deq is None else self.deq.t()
        q = None if self.q is None else self.q.t()
        return Operand(q, self.scale.t(), (self.block[1], self.block[0]), deq, self.cache)

    def dequantized(self) -> torch.Tensor:
        """deq, or q * scale computed now (FP32 [R, K])."""
        if self.deq is not None:
            return self.deq
        return dequantize_2d(self.q, self.scale, self.block)
