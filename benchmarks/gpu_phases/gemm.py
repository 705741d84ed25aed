"""Phase 2: the FP8 GEMM preflight and the hardware blockwise GEMM against the exact emulation.

Cases, in order:
  select_executor  on an SM90 GPU it must pick "scaled_mm" (else `fail`, with the error of a direct
               scaled_mm call on a small GEMM: the start-up probe swallows it); on a CPU, what CPU runs use.
  preflight eager / preflight compiled (the latter last in the phase)
               fp8rl_core.fp8.preflight over every distinct GEMM shape of the GRPO phase's policy
               (models.policy) at a decode-sized and a training-sized M (--preflight-ms; compiled:
               --preflight-compiled-ms and -max; --cpu: 3 shapes at M = 4) against its float64 reference and bound
               (docs/design.md): the worst error as a fraction of the bound (`ratio`) and its shape; failing
               shapes make the row `fail`, naming the first. One shape at a time, so that the phase budget can
               stop it between shapes (the note says how many were checked): Inductor compiles each shape
               afresh, seconds each. Compiled uses --compile-backend (inductor; --cpu aot_eager, where
               Inductor's C++ build takes minutes). --cpu: small M, the CPU's own executor.
  blockwise GEMM  blockwise_scaled_mm [executor] at M = K = N = --gemm-size (4096; --cpu 256), A (1,128) x
               B (128,128) (forward/dgrad) and (1,128) x (1,128) (wgrad), against the BF16 matmul of the same
               size (`x baseline` = time / BF16's; TFLOP/s = 2 M N K / time) and against the emulation on the
               same quantized operands (`max rel diff`, normwise). --cpu: emulated_blockwise vs emulated
               (--executor tests another one).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Iterator

from gpu_phases import models
from gpu_phases.common import Run, installed, rel_diff, row

PHASE = "preflight"
PREFLIGHT = "fp8rl_core.fp8.preflight"
GEMM_TOL = 1e-2  # normwise; the per-element bound is the preflight's (docs/design.md)


def run(run: Run) -> None:
    run.case(PHASE, "select_executor", lambda: executor_row(run))
    run.case(PHASE, "preflight eager", lambda: preflight_rows(run, "preflight eager", compiled=False))
    for block_b in ((128, 128), (1, 128)):
        name = f"blockwise GEMM 1x128 x {block_b[0]}x{block_b[1]} M=K=N={run.args.gemm_size}"
        run.case(PHASE, name, lambda b=block_b, n=name: gemm_rows(run, n, b))
    # last: Inductor compiles every shape afresh (seconds each), so the phase budget may stop it part-way
    run.case(PHASE, "preflight compiled", lambda: preflight_rows(run, "preflight compiled", compiled=True))


def hardware_executor(run: Run) -> str:
    """The executor under test: --executor, else $FP8RL_GEMM, else select_executor's (on a GPU scaled_mm; with
    --cpu cpu_bf16dot on an AMX CPU); where the choice is the emulation, "emulated_blockwise" (DeepSeek's
    per-K-block order: a second code path to meet the "emulated" reference)."""
    from fp8rl_core.fp8 import select_executor

    name = run.args.executor or os.environ.get("FP8RL_GEMM") or select_executor(run.device)
    return "emulated_blockwise" if name == "emulated" else name


def executor_row(run: Run) -> list[dict]:
    import torch

    from fp8rl_core.fp8 import select_executor

    chosen = select_executor(run.device)
    if run.cpu:
        return [row(PHASE, "select_executor", note=f"{chosen} (what CPU runs use)",
                    data={"executor": chosen})]
    cap = torch.cuda.get_device_capability(run.device)
    if chosen == "scaled_mm" or cap != (9, 0):
        status = "ok" if chosen == "scaled_mm" else "skipped"
        return [row(PHASE, "select_executor", status, note=f"{chosen} on sm_{cap[0]}{cap[1]}",
                    data={"executor": chosen, "capability": list(cap)})]
    said = direct_scaled_mm(run)
    return [row(PHASE, "select_executor", "fail", data={"executor": chosen, "direct_call": said},
                note=f"{chosen} on sm_90, expected scaled_mm; a direct call says: {said}")]


def direct_scaled_mm(run: Run) -> str:
    """What cuda_exec's scaled_mm does on a small GEMM, without the probe's silence: the error, or its diff."""
    import torch

    from fp8rl_core.fp8 import cuda_exec, emulate
    from fp8rl_core.fp8.operand import Operand
    from fp8rl_core.fp8.quant import quantize_blockwise

    x, w = torch.randn(6, 384, device=run.device), torch.randn(256, 384, device=run.device)
    a, b = Operand(*quantize_blockwise(x, (1, 128)), (1, 128)), Operand(*quantize_blockwise(w, (128, 128)), (128, 128))
    try:
        got = cuda_exec.run_scaled_mm(a, b, torch.float32)
    except Exception as exc:  # noqa: BLE001  (the very thing to report)
        return f"{type(exc).__name__}: {str(exc).strip()[:300]}"
    return f"ran; max rel diff vs emulation {rel_diff(got, emulate.fold_mm(a, b, torch.float32)):.2e}"


@contextlib.contextmanager
def compile_backend(pf, backend: str) -> Iterator[None]:
    """The preflight's torch.compile backend for the block (--compile-backend: aot_eager with --cpu)."""
    old = pf.COMPILE_BACKEND
    pf.COMPILE_BACKEND = backend
    try:
        yield
    finally:
        pf.COMPILE_BACKEND = old


def preflight_rows(run: Run, name: str, compiled: bool) -> list[dict]:
    """run_preflight one shape at a time (its public API on a one-shape list), so that the phase budget can
    stop it between shapes: the row says how many were checked; every failing shape is collected."""
    if not installed(PREFLIGHT):
        return [row(PHASE, name, "skipped", note=f"{PREFLIGHT} is not in this tree")]
    pf = importlib.import_module(PREFLIGHT)
    ms = list(run.args.preflight_compiled_ms if compiled else run.args.preflight_ms)
    shapes = pf.model_shapes(models.policy(run.cpu), ms)
    cap = run.args.preflight_compiled_max if compiled else 0
    capped = f"; the first {cap} of {len(shapes)} (--preflight-compiled-max)" if 0 < cap < len(shapes) else ""
    shapes = shapes[:cap] if capped else shapes
    worst, worst_shape, failures, executor, stopped, checked = 0.0, None, [], None, "", len(shapes)
    t0 = time.perf_counter()
    with compile_backend(pf, run.args.compile_backend) if compiled else contextlib.nullcontext():
        for i, shape in enumerate(shapes):
            why = run.clock.why_not(PHASE)
            if why and i:
                stopped, checked = f"; stopped after {i} of {len(shapes)} shapes: {why}", i
                break
            try:
                res = pf.run_preflight([shape], run.device, executor=run.args.executor, compiled=compiled, seed=i)
            except pf.PreflightError as exc:
                failures.append(str(exc).strip())
                continue
            executor = res.executor
            if res.worst_ratio >= worst:
                worst, worst_shape = res.worst_ratio, shape
    where = "-" if worst_shape is None else worst_shape.describe()
    data = {"shapes": len(shapes), "checked": checked, "failed": len(failures), "ms": ms, "worst_ratio": worst,
            "worst_shape": where, "executor": executor, "failures": failures[:8]}
    seconds = time.perf_counter() - t0
    if failures:
        return [row(PHASE, name, "fail", time_ms=seconds * 1e3, data=data,
                    note=f"{len(failures)} of {checked} shapes fail the bound; first: {failures[0][:400]}")]
    return [row(PHASE, name, time_ms=seconds * 1e3, ratio=worst, data=data,
                note=f"{checked} of {len(shapes)} shapes (M in {ms}) within the bound on {executor}"
                     f"{' (' + run.args.compile_backend + ')' if compiled else ''}; worst {worst:.3f} of the bound "
                     f"at {where}{stopped}{capped}")]


def gemm_rows(run: Run, name: str, block_b: tuple[int, int]) -> list[dict]:
    import torch
    from fp8_numerics import best_times

    from fp8rl_core.fp8 import blockwise_scaled_mm, quantize_blockwise

    n, dev, executor = run.args.gemm_size, run.device, hardware_executor(run)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, n, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(n, n, device=dev, generator=g).to(torch.bfloat16)
    (qa, sa), (qb, sb) = quantize_blockwise(x, (1, 128)), quantize_blockwise(w, block_b)

    def mm(name: str):
        return lambda: blockwise_scaled_mm(qa, sa, qb, sb, block_a=(1, 128), block_b=block_b, executor=name)

    cases = {"bf16": lambda: x @ w.t(), executor: mm(executor)}
    t = best_times(cases, run.args.repeats, dev)
    diff = rel_diff(mm(executor)(), mm("emulated")())
    flops = 2 * n**3
    status = "ok" if diff <= GEMM_TOL else "fail"
    return [row(PHASE, f"{name} bf16 matmul", time_ms=t["bf16"] * 1e3, ratio=1.0, tflops=flops / t["bf16"] / 1e12,
                note="baseline"),
            row(PHASE, f"{name} [{executor}]", status, time_ms=t[executor] * 1e3, ratio=t[executor] / t["bf16"],
                tflops=flops / t[executor] / 1e12, max_rel_diff=diff,
                note=f"vs emulated on the same operands (tolerance {GEMM_TOL:g}); first call "
                     f"{t['first call ' + executor] * 1e3:.0f} ms")]
