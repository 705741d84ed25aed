"""The error bound of every FP8 GEMM executor: its one home in code (docs/design.md, "3. Numerics").

For C = A . B^T computed from E4M3 codes QA [M, K], QB [N, K] and FP32 block scales sa, sb (K-blocks of 128):

    |C - C_ref| <= 2**-9 * C_abs,   C_abs = sum_kb |sa_kb| |sb_kb| (|QA_kb| @ |QB_kb|^T)

C_ref is the float64 result from the same codes and scales (dequantized in float64, where a 4-bit code
times a 24-bit scale is exact, then one float64 GEMM: within K * 2**-53 * C_abs, negligible); where C_abs
is 0, C must be 0. 2**-9: Hopper accumulates FP8 products with ~14 bits inside a K-block (DeepSeek-V3
section 3.3.2); the CPU executors are far inside it ((K + 4) * 2**-24 * C_abs, tests/fp8rl_core/fp8/
test_gemm.py); one BF16 rounding of C just fits; a misplaced scale or a dropped K-block does not.
Used by the FP8 GEMM preflight (preflight.py) and the scaled_mm startup probe (cuda_exec.py).
"""
from __future__ import annotations

import math

import torch

from fp8rl_core.fp8.operand import Operand

BOUND_EXPONENT = -9
BOUND = 2.0**BOUND_EXPONENT
BOUND_TEXT = ("|C - C_ref| <= 2^-9 * C_abs, C_abs = sum_kb |sa||sb| (|QA_kb| @ |QB_kb|^T), "
              "C_ref in float64 from the same E4M3 codes and scales")
_CHUNK_ELEMENTS = 2**24  # float64 reference: operand rows per chunk x K stays below this
_OUT_CHUNK = 2048  # and rows per chunk at most this (an output block of 2048 x 2048 float64)
_TINY = 5e-324  # the least positive double


def _dequant64(op: Operand, r0: int, r1: int) -> torch.Tensor:
    """Rows r0:r1 of op's q * scale in float64 (exact: a 4-bit code times a 24-bit scale); r0 a multiple
    of op.block[0]. The scale is broadcast over each K-block, never expanded to [rows, K]."""
    (br, bk), k, rows = op.block, op.q.shape[1], r1 - r0
    out = op.q[r0:r1].to(torch.float64, memory_format=torch.contiguous_format)
    s = op.scale[r0 // br: -(-r1 // br)].double()
    s = s if br == 1 else s.repeat_interleave(br, 0)[:rows]  # [rows, Kb]
    full = k // bk
    out[:, : full * bk].view(rows, full, bk).mul_(s[:, :full, None])
    if k % bk:
        out[:, full * bk:].mul_(s[:, full:])
    return out


def _chunk_rows(k: int) -> int:
    """Operand rows per chunk: rows x K and rows x rows (the output block) stay bounded."""
    return max(128, min(_OUT_CHUNK, _CHUNK_ELEMENTS // max(k, 1)) // 128 * 128)


def bound_ratio(c: torch.Tensor, a: Operand, b: Operand) -> tuple[float, tuple[int, int]]:
    """(max over elements of |C - C_ref| / (2**-9 C_abs), where): <= 1 passes. Inf where C_abs is 0
    and C is not, or C is not finite. Computed in chunks of rows and columns (bounded memory)."""
    (m, k), n = a.q.shape, b.q.shape[0]
    if tuple(c.shape) != (m, n):
        raise ValueError(f"the executor returned shape {tuple(c.shape)}, expected {(m, n)}")
    step = _chunk_rows(k)
    worst, where = 0.0, (0, 0)
    for r0 in range(0, m, step):
        a64 = _dequant64(a, r0, min(r0 + step, m))
        for c0 in range(0, n, step):
            b64 = _dequant64(b, c0, min(c0 + step, n))
            ratio = (a64 @ b64.t()).sub_(c[r0:r0 + a64.shape[0], c0:c0 + b64.shape[0]]).abs_()  # |C - C_ref|
            # / C_abs, floored at the least double: where C_abs is 0, an error of 0 gives 0 and any other inf;
            # a NaN/inf in C gives NaN/inf -> inf
            ratio.div_((a64.abs() @ b64.abs().t()).clamp_min_(_TINY)).nan_to_num_(nan=math.inf)
            flat = int(ratio.argmax())
            value = float(ratio.view(-1)[flat]) / BOUND
            if value > worst:
                worst, where = value, (r0 + flat // ratio.shape[1], c0 + flat % ratio.shape[1])
    return worst, where
