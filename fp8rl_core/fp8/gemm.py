"""Blockwise-scaled FP8 GEMM (DeepSeek-V3 `fp8_gemm` semantics), one function, several executors.

    C[M, N] = sum_kb  scale_a[m, kb] * scale_b[n, kb] * P_kb[m, n],
    P_kb[m, n] = sum_{k in K-block kb} qa[m, k] * qb[n, k]     (exact E4M3 products, FP32 accumulation)

A is [M, K] and B is [N, K] (C = A @ B^T, the "TN" layout of an nn.Linear weight). Both operands are
quantized along K with the same K-block (128); A's blocks are (1, 128) (or (128, 128)) and B's
(1, 128) or (128, 128). Executors (chosen by `select_executor`; env FP8RL_GEMM=<name> overrides):
  "emulated"            FP32 GEMM of the dequantized operands (any device; the default on other CPUs), emulate.py
  "emulated_blockwise"  DeepSeek's per-K-block order literally (reference; slower), emulate.py
  "cpu_bf16dot"         DeepSeek's order on the CPU's BF16 dot products (AMX or AVX512_BF16, cpu_gemm.py;
                        the static default where AMX is present)
  "scaled_mm"           torch blockwise scaled_mm on Hopper (SM90, cuBLAS >= 12.9), cuda_exec.py
Precedence: a per-call `executor` > the run's pin (`fp8.gemm`, `pin_executor`; it and $FP8RL_GEMM must agree)
> $FP8RL_GEMM > the run's automatic decision (`decide`: on the CPU a calibration, calibrate.py, shared by the
cells of a sweep, choice.py) > `default_executor`, the static rule (processes that decided nothing). The
calibration's trials (`trying`) rank just below the per-call executor.
(There is no "te" executor: Transformer Engine runs FP8 end to end inside the Megatron-Core backend.)
`executor_flags()`: what a run can log about the GEMMs so far (a BF16-output fallback, cuda_exec.py).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from fp8rl_core.fp8 import cpu_features
from fp8rl_core.fp8.operand import Operand
from fp8rl_core.fp8.quant import FP8_DTYPE, Block, check_block, scale_shape

EXECUTORS = ("emulated", "emulated_blockwise", "cpu_bf16dot", "scaled_mm")
ENV_VAR = "FP8RL_GEMM"
_pinned: str | None = None  # the run's `fp8.gemm` (pin_executor); None: $FP8RL_GEMM, else automatic
# the run's automatic choice per device type, with the $FP8RL_CPU_FLAGS_OFF it was made under (`decide`)
_decided: dict[str, tuple[str, str]] = {}
_trial: str | None = None  # calibrate.py's measurement of one executor (`trying`)


def pin_executor(name: str | None, device: torch.device | str = "cpu") -> None:
    """Pin this process's executor (a run's `fp8.gemm`; "auto": unpin; None: unpin and forget the automatic
    decision too). Raises ValueError for an
    unknown name, one that cannot run on `device`, or a $FP8RL_GEMM that says otherwise: the pin is part
    of the run's cell id, so a silently different executor would put wrong numbers under that id."""
    global _pinned
    if name in (None, "auto"):
        _pinned = None
        if name is None:
            _decided.clear()
        return
    if name not in EXECUTORS:
        raise ValueError(f"fp8.gemm: unknown executor {name!r}; valid: auto, {', '.join(EXECUTORS)}")
    env = os.environ.get(ENV_VAR)
    if env and env != name:
        raise ValueError(f"fp8.gemm: the run config pins {name!r} but ${ENV_VAR}={env!r}; unset {ENV_VAR} or "
                         f"set fp8.gemm={env} (the config's value is part of the cell id)")
    if name == "scaled_mm" and torch.device(device).type != "cuda":
        raise ValueError(f"fp8.gemm: 'scaled_mm' runs on a CUDA device (Hopper) only, this run is on {device}; "
                         f"valid here: auto, {', '.join(e for e in EXECUTORS if e != 'scaled_mm')}")
    _pinned = name


def decide(device: torch.device | str, name: str | None) -> None:
    """Record the run's automatic choice for `device`'s type (None: forget it): choice.py, at run start."""
    kind = torch.device(device).type
    if name is None:
        _decided.pop(kind, None)
        return
    if name not in EXECUTORS:
        raise ValueError(f"unknown executor {name!r}; valid: {', '.join(EXECUTORS)}")
    _decided[kind] = (name, os.environ.get(cpu_features.ENV_OFF, ""))


@contextlib.contextmanager
def trying(name: str) -> Iterator[None]:
    """Run the block's GEMMs on `name` whatever the pin, env or decision say (the calibration's trials)."""
    global _trial
    old, _trial = _trial, name
    try:
        yield
    finally:
        _trial = old


def select_executor(device: torch.device | str, override: str | None = None) -> str:
    """The executor for a GEMM on `device`: override > the pinned one (fp8.gemm) > $FP8RL_GEMM > the run's
    decision (`decide`) > the static rule (`default_executor`)."""
    choice = override or _trial or _pinned or os.environ.get(ENV_VAR) or None
    if choice is not None:
        if choice not in EXECUTORS:
            raise ValueError(f"{ENV_VAR}/executor: unknown executor {choice!r}; valid: {', '.join(EXECUTORS)}")
        return choice
    device = torch.device(device)
    decided = _decided.get(device.type)  # one made under other hidden flags (tests) does not apply
    if decided is not None and decided[1] == os.environ.get(cpu_features.ENV_OFF, ""):
        return decided[0]
    return default_executor(device)


def default_executor(device: torch.device | str) -> str:
    """The static rule: on CUDA the first hardware executor (scaled_mm on SM90) else emulated; on the CPU
    cpu_bf16dot where its path is AMX (cpu_gemm.preferred), else emulated. The calibration's default."""
    device = torch.device(device)
    if device.type == "cuda":
        from fp8rl_core.fp8 import cuda_exec  # lazy: CUDA-only code

        available = cuda_exec.available_executors(device)
        return available[0] if available else "emulated"
    if device.type == "cpu":
        from fp8rl_core.fp8 import cpu_gemm  # lazy: builds its C kernels on first use

        return "cpu_bf16dot" if cpu_gemm.preferred() else "emulated"
    return "emulated"


def executor_flags() -> dict[str, float]:
    """{"fp8_gemm_bf16_output_fallback": 1.0} once any CUDA device fell back from FP32 to BF16 GEMM
    output (cuda_exec.py; it also warned), else {}: a flag to log with a step's metrics."""
    import sys

    cuda_exec = sys.modules.get("fp8rl_core.fp8.cuda_exec")  # never imported: no CUDA GEMM ran, nothing to say
    return {"fp8_gemm_bf16_output_fallback": 1.0} if cuda_exec is not None and cuda_exec.fallbacks() else {}


def _check_operands(a: Operand, b: Operand) -> None:
    for name, op in (("qa", a), ("qb", b)):
        if op.q.dtype != FP8_DTYPE or op.q.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D float8_e4m3fn tensor, "
                             f"got {op.q.dtype} of shape {tuple(op.q.shape)}")
    if a.q.shape[1] != b.q.shape[1]:
        raise ValueError(f"qa {tuple(a.q.shape)} and qb {tuple(b.q.shape)}: contraction dims (K) differ")
    if a.block[1] != b.block[1]:
        raise ValueError(f"block_a {a.block} and block_b {b.block}: K-block sizes differ")
    for name, op in (("sa", a), ("sb", b)):
        want = scale_shape(tuple(op.q.shape), op.block)
        if tuple(op.scale.shape) != want or op.scale.dtype != torch.float32:
            raise ValueError(
                f"{name}: expected float32 of shape {want} for block {op.block}, "
                f"got {op.scale.dtype} {tuple(op.scale.shape)}"
            )


def blockwise_scaled_mm(
    qa: torch.Tensor,
    sa: torch.Tensor,
    qb: torch.Tensor,
    sb: torch.Tensor,
    *,
    block_a: Block = (1, 128),
    block_b: Block = (128, 128),
    out_dtype: torch.dtype = torch.float32,
    executor: str | None = None,
) -> torch.Tensor:
    """C[M, N] = A[M, K] @ B[N, K]^T with per-block scales; see the module docstring.

    qa: E4M3 [M, K], sa: FP32 [ceil(M/ba0), ceil(K/kb)]; qb: E4M3 [N, K], sb: FP32 [ceil(N/bb0), ceil(K/kb)].
    Returns C in out_dtype (accumulated in FP32, cast once at the end).
    """
    a = Operand(qa, sa, check_block(block_a, "block_a"))
    b = Operand(qb, sb, check_block(block_b, "block_b"))
    _check_operands(a, b)
    return scaled_mm(a, b, out_dtype=out_dtype, executor=executor)


def scaled_mm(a: Operand, b: Operand, *, out_dtype: torch.dtype, executor: str | None = None,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """blockwise_scaled_mm on validated Operands (the entry used inside the package), plus an optional
    bias [N] added to the FP32 result before the one cast to out_dtype (the linear's epilogue: cpu_bf16dot
    does both inside its kernel, the others here; the same bits either way)."""
    name = select_executor(a.scale.device, executor)
    if name == "cpu_bf16dot":
        from fp8rl_core.fp8 import cpu_gemm

        return cpu_gemm.mm(a, b, out_dtype, bias=bias)
    if name in ("emulated", "emulated_blockwise"):
        from fp8rl_core.fp8 import emulate

        run = emulate.fold_mm if name == "emulated" else emulate.blockwise_mm
        c = run(a, b, torch.float32)
    else:
        from fp8rl_core.fp8 import cuda_exec  # lazy: CUDA-only code

        c = cuda_exec.run(name, a, b, torch.float32)
    if bias is not None:
        c += bias.to(torch.float32)
    return c if out_dtype == torch.float32 else c.to(out_dtype)
