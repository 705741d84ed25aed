"""Phase 2: the FP8 GEMM preflight and the hardware blockwise GEMM against the exact emulation.

Cases, in order:
  select_executor  on an SM90 GPU it must pick "scaled_mm" (else `fail`, with the error of a direct
               scaled_mm call on a small GEMM: the start-up probe swallows it); on a CPU, what CPU runs use.
  8B plan      the FP8 GEMM shapes of the 8B cluster sweep (models.plan_shapes: `sweep plan --preflight`'s list,
               Llama-3.1-8B's fprop / dgrad / wgrad at the sweep's M = 256 decoded rows and 4608 training
               tokens per rank: 24 shapes), one case each: the executor under test against the exact
               emulation (the preflight's float64 C_ref from the same E4M3 codes and scales) under the bound
               (`x baseline` = the error as a fraction of the bound, as in every preflight row), timed (best
               of --repeats) beside the BF16 matmul of the same GEMM; then a row `8B plan: all shapes`, the
               worst. Cost on an H200, from FLOPs: 4.0 TFLOP per pass over the 24 shapes, 7 FP8 and 6 BF16
               calls each (~28 TFLOP apiece, ~40 ms at ~0.7 PFLOP/s); the exact emulation is the slow side, two
               float64 GEMMs per shape, 8.1 TFLOP (~0.2 s at ~50 TFLOP/s): a few seconds with operand generation
               and first calls, so every shape runs at the plan's full M; no 8B shape starts once the phase has
               less than PLAN_RESERVE_S left (kept for the cases below). --cpu: the same sweep and code on the
               tiny policy at M = 5 (12 shapes), and `8B plan: scaled_mm layouts (meta)`: the executor's calls at
               the real 24 shapes on the meta device, where torch checks the blockwise scale shapes and strides.
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
PLAN_RESERVE_S = 20.0  # an 8B plan shape starts only while the phase has this much left: the cases after it
PLAN = "8B plan"


def run(run: Run) -> None:
    run.case(PHASE, "select_executor", lambda: executor_row(run))
    plan_cases(run)
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


def plan_cases(run: Run) -> None:
    """The 8B plan's shapes, one case each (see the module docstring), then the summary row."""
    from fp8rl_core.fp8.gemm_bound import BOUND_TEXT

    listed = run.case(PHASE, f"{PLAN}: shapes", lambda: [plan_list_row(run)])
    shapes = run.shared.get("plan_shapes")
    if not shapes or listed[0]["status"] != "ok":
        return
    if run.cpu:
        run.case(PHASE, f"{PLAN}: scaled_mm layouts (meta)", lambda: [meta_layout_row(run)])
    done: list[dict] = []
    for i, shape in enumerate(shapes):
        case = f"{PLAN}: {shape.describe()}"
        own = run.clock.phase_left(PHASE)
        if own < PLAN_RESERVE_S:
            done += run.report.add([row(PHASE, case, "skipped", note=f"not started: {own:.0f} s left in phase "
                                        f"{PHASE}, {PLAN_RESERVE_S:.0f} s kept for its other cases")])
            continue
        done += run.case(PHASE, case, lambda s=shape, seed=i: plan_shape_rows(run, s, seed))
    measured = [r for r in done if r["status"] in ("ok", "fail")]
    bad = [r for r in done if r["status"] in ("fail", "error")]
    worst = max(measured, key=lambda r: r["ratio"], default=None)
    t_exec, t_bf16 = (sum(r["data"][k] for r in measured) for k in ("ms", "bf16_ms"))
    t_ref = sum(r["data"]["reference_ms"] for r in measured) / 1e3
    note = (f"{len(measured)} of {len(shapes)} shapes measured, {len(bad)} fail or error"
            + (f" (first: {bad[0]['case'].removeprefix(PLAN + ': ')}: {bad[0]['note'][:200]})" if bad else "")
            + ("" if worst is None else f"; worst {worst['ratio']:.3f} of the bound at "
               f"{worst['case'].removeprefix(PLAN + ': ')}; {hardware_executor(run)} {t_exec:.1f} ms in all vs "
               f"BF16 {t_bf16:.1f} ms; the exact emulation {t_ref:.2f} s")
            + f". Bound: {BOUND_TEXT}")
    status = "fail" if bad else ("ok" if len(measured) == len(shapes) else "skipped")
    run.report.add([row(PHASE, f"{PLAN}: all shapes", status, time_ms=t_exec or None,
                        ratio=None if worst is None else worst["ratio"], note=note,
                        data={"shapes": len(shapes), "measured": len(measured), "failed": len(bad),
                              "worst": None if worst is None else worst["case"], "bf16_ms": t_bf16,
                              "reference_s": t_ref})])


def plan_list_row(run: Run) -> dict:
    shapes, what = models.plan_shapes(run.work, run.cpu)
    run.shared["plan_shapes"] = shapes
    ms = sorted({s.m for s in shapes})
    tflop = sum(2 * s.m * s.k * s.n for s in shapes) / 1e12
    return row(PHASE, f"{PLAN}: shapes", note=f"{len(shapes)} shapes (M in {ms}; {tflop:.3g} TFLOP per pass over "
               f"them) from {what}", data={"shapes": [s.describe() for s in shapes], "ms": ms, "tflop": tflop})


def meta_layout_row(run: Run) -> dict:
    """--cpu: the scaled_mm executor's own calls (cuda_exec.run_scaled_mm: padding, scale layouts, FP32 output)
    at the real 8B plan's shapes on the meta device, where torch's scaled_mm runs its shape and stride checks
    of the blockwise recipes without a GPU. A control call with a wrong scale layout must be refused, else
    this torch's meta kernel checks nothing and the row is `skipped`."""
    import torch
    import torch.nn.functional as F

    from fp8rl_core.fp8 import cuda_exec
    from fp8rl_core.fp8.preflight import make_operands

    meta = torch.device("meta")
    shapes, _ = models.plan_shapes(run.work, cpu=False)
    a, b = make_operands(shapes[0], meta, None)  # type: ignore[arg-type]  (meta: no generator)
    try:
        F.scaled_mm(a.q, b.q.t(), a.scale.contiguous(), F.ScalingType.BlockWise1x128, b.scale,
                    F.ScalingType.BlockWise128x128, output_dtype=torch.float32)
        return row(PHASE, f"{PLAN}: scaled_mm layouts (meta)", "skipped",
                   note=f"torch {torch.__version__}'s meta scaled_mm accepts a wrong scale layout: it checks nothing")
    except (RuntimeError, ValueError):
        pass
    failures = []
    for shape in shapes:
        a, b = make_operands(shape, meta, None)  # type: ignore[arg-type]
        rows_c, _, cols = shape.gemm_dims()
        try:
            c = cuda_exec.run_scaled_mm(a, b, torch.float32)
            if tuple(c.shape) != (rows_c, cols) or c.dtype != torch.float32:
                failures.append(f"{shape.describe()}: {c.dtype} {tuple(c.shape)}")
        except (RuntimeError, ValueError) as exc:
            failures.append(f"{shape.describe()}: {str(exc).strip()[:300]}")
    if cuda_exec.fallbacks():
        failures.append(f"FP32 output refused: {cuda_exec.fallbacks()}")
    status = "fail" if failures else "ok"
    note = (f"{len(shapes) - len(failures)} of {len(shapes)} 8B shapes: cuda_exec.run_scaled_mm's operands and scales "
            f"pass torch {torch.__version__}'s blockwise scaled_mm shape and stride checks (meta device; a wrong scale "
            "layout is refused there), FP32 output" + (f"; first failure: {failures[0]}" if failures else ""))
    return row(PHASE, f"{PLAN}: scaled_mm layouts (meta)", status, note=note, data={"failures": failures[:8]})


def plan_shape_rows(run: Run, shape, seed: int) -> list[dict]:
    """One 8B plan shape: the executor under test, timed, against the exact emulation under the bound."""
    import torch
    from fp8_numerics import best_times

    from fp8rl_core.fp8 import gemm as fp8_gemm
    from fp8rl_core.fp8.gemm_bound import bound_ratio
    from fp8rl_core.fp8.preflight import make_operands

    dev, executor = run.device, hardware_executor(run)
    g = torch.Generator(device=dev).manual_seed(seed)
    a, b = make_operands(shape, dev, g)
    rows_c, inner, cols = shape.gemm_dims()
    x = torch.randn(rows_c, inner, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(cols, inner, device=dev, generator=g).to(torch.bfloat16)

    def fp8() -> object:
        return fp8_gemm.blockwise_scaled_mm(a.q, a.scale, b.q, b.scale, block_a=a.block, block_b=b.block,
                                            out_dtype=torch.float32, executor=executor)

    t = best_times({"bf16": lambda: x @ w.t(), executor: fp8}, run.args.repeats, dev)
    c = fp8()
    t0 = time.perf_counter()
    ratio, (i, j) = bound_ratio(c, a, b)  # returns floats: synchronized
    t_ref = time.perf_counter() - t0
    flops = 2 * rows_c * inner * cols
    status = "ok" if ratio <= 1.0 else "fail"
    data = {"pass": shape.pass_name, "layer": shape.layer, "m": shape.m, "k": shape.k, "n": shape.n,
            "gemm_dims": [rows_c, inner, cols], "executor": executor, "ms": t[executor] * 1e3,
            "bf16_ms": t["bf16"] * 1e3, "first_call_ms": t["first call " + executor] * 1e3,
            "reference_ms": t_ref * 1e3, "bound_ratio": ratio, "where": [i, j]}
    return [row(PHASE, f"{PLAN}: {shape.describe()}", status, time_ms=t[executor] * 1e3, ratio=ratio,
                tflops=flops / t[executor] / 1e12, data=data,
                note=f"{executor} {t[executor] * 1e3:.2f} ms vs BF16 matmul {t['bf16'] * 1e3:.2f} ms "
                     f"(x {t[executor] / t['bf16']:.2f}); error {ratio:.3f} of the bound at C[{i}, {j}] against the "
                     f"exact emulation (float64, {t_ref * 1e3:.0f} ms); first call {data['first_call_ms']:.0f} ms")]


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
