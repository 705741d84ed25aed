"""Pure-torch executors of the blockwise-scaled FP8 GEMM (any device; the CPU path of the study).

Both compute, in FP32 arithmetic, C = sum_kb diag(sa_kb) (QA_kb QB_kb^T) diag(sb_kb) on the exact
E4M3 values, and both are within the FP32 rounding bound of the exact (float64) result (see tests):

- "emulated" (default): one FP32 GEMM of the dequantized operands, A_hat = QA * sa and B_hat = QB * sb
  (each element rounded once to FP32), accumulated over all of K in FP32.
      |C - C_exact| <= (K + 4) * 2**-24 * C_abs,   C_abs = sum_kb |sa||sb| (|QA_kb| @ |QB_kb|^T)
  Mathematically the same sum; only the FP32 rounding order differs from DeepSeek's kernel (as it
  does between GPU kernels, whose in-block accumulation is even coarser).
  It costs one FP32 GEMM: on these CPUs there is no BF16 x BF16 -> FP32 matmul in torch, and a BF16
  output is rounded to 8 bits, so no BF16 matmul can give FP32-accurate sums.
- "emulated_blockwise": DeepSeek's fp8_gemm order literally: per K-block, an FP32 GEMM of the raw
  E4M3 values (products exact in FP32), then `(P_kb * sa) * sb` added to an FP32 accumulator.
      |C - C_exact| <= (bk + Kb + 2) * 2**-24 * C_abs
  Slower (two extra passes over C per K-block); the reference for comparing executors.
FP32 matmuls here never use reduced-precision modes (TF32, oneDNN BF16), whatever the global setting.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fp8rl_core.fp8.operand import Operand


@contextlib.contextmanager
def ieee_fp32_matmul(device_type: str) -> Iterator[None]:
    """Force IEEE FP32 matmuls (no TF32 / implicit BF16) for the duration of the block."""
    backend = torch.backends.cuda.matmul if device_type == "cuda" else torch.backends.mkldnn.matmul
    old = getattr(backend, "fp32_precision", None)
    if old is None:  # older torch: only the CUDA TF32 switch exists
        old_tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old_tf32
        return
    if old == "ieee" or (old == "none" and torch.get_float32_matmul_precision() == "highest"):
        yield
        return
    backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        backend.fp32_precision = old


def fold_mm(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """C [M, N] = A_hat @ B_hat^T in FP32, A_hat = dequantized A [M, K], B_hat = dequantized B [N, K]."""
    a_hat, b_hat = a.dequantized(), b.dequantized()
    with ieee_fp32_matmul(a_hat.device.type):
        c = torch.mm(a_hat, b_hat.t())
    return c if out_dtype == torch.float32 else c.to(out_dtype)


def _row_scales(op: Operand) -> torch.Tensor:
    """Per-block scale [ceil(R/br), Kb] -> per-row scale [R, Kb]."""
    br = op.block[0]
    return op.scale if br == 1 else op.scale.repeat_interleave(br, dim=0)[: op.q.shape[0]]


def blockwise_mm(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek order: C += (QA_kb @ QB_kb^T) * sa_kb[:, None] * sb_kb[None, :], all in FP32."""
    (m, k), n, bk = a.q.shape, b.q.shape[0], a.block[1]
    qa, qb = a.q.float(), b.q.float()
    sa, sb = _row_scales(a), _row_scales(b)
    out = torch.zeros(m, n, dtype=torch.float32, device=a.q.device)
    part = torch.empty_like(out)
    with ieee_fp32_matmul(out.device.type):
        for kb, k0 in enumerate(range(0, k, bk)):
            torch.mm(qa[:, k0 : k0 + bk], qb[:, k0 : k0 + bk].t(), out=part)
            out += part.mul_(sa[:, kb, None]).mul_(sb[None, :, kb])
    return out if out_dtype == torch.float32 else out.to(out_dtype)
