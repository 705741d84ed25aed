"""Usage: python benchmarks/fp8_numerics.py [--quick] [--compile off|on] [--device cpu|cuda] [--repeats N]
                                         [--executors a,b] [--tokens M] [--sizes 256,1024] [--no-quant]
                                         [--threads N] [--bf16] [--clock wall|cpu] [--only cpu-paths]

Blockwise-FP8 numerics speed, every number measured in this one run against a baseline of the same run
(issue 16's goals in the `goal` column):
  1. quantize + dequantize of an S x S BF16 tensor (S = 4096; DRAM-resident), blocks (1,128) and
     (128,128), vs a plain copy of the same bytes into a buffer (effective GB/s = 2 * bytes(x) / time;
     ratio = copy time / time, goal >= 0.5): the pure-torch reference (`reference`, FP8RL_FUSED=0),
     the fused C kernel (`fused`, the CPU default) and, with --compile on, torch.compile'd kernels;
  2. Fp8Linear forward + backward at M tokens (2048), K = N in a list (256, 1024), vs nn.Linear in FP32
     (the floor of an exact CPU emulation: FP32 GEMMs; ratio = time / FP32 time, goal <= 1.25) and, with
     --bf16 (always on CUDA), in BF16, with TFLOP/s (3 GEMMs of 2*M*N*K each); Fp8Linear with BF16
     activations (the BF16 training case) and, `fp32 act`, FP32 ones (model.dtype fp32: the study's setting
     on a CPU without BF16 hardware, no casts around the layer, as the FP32 baseline). The weight is re-quantized
     in every timed step (`invalidate()`): the most that once per optimizer step costs; `reference` runs
     the pure-torch quantizer (FP8RL_FUSED=0).
On the CPU, issue 25's rows, for the CPU it runs on (the header names the kernel flags, the fused quantizer's
vector path and the GEMM executor they chose; `--only cpu-paths` runs just these):
  3. FP32 quantize + dequantize of S x S (public functions, fused kernel) vs a copy into a buffer: ratio
     copy / (quantize + dequantize), goal >= 0.5 on the AVX-512 path (~0.29 was the AVX2 path's floor); the
     library's own combination (FP32 dequantized copy, no codes: the emulated GEMM's activations); and the
     floor of any function returning a fresh FP32 S x S tensor (huge-page-advised, written once);
  4. Fp8Linear forward + backward (BF16 x and dY, FP32 master weights, re-quantized each step) vs nn.Linear in
     BF16, M = 2048, K = N in (256, 1024), 1 thread and the default threads: the selected executor (goal
     ratio <= 1.0 where the CPU has BF16 dot products, avx512_bf16 or amx_bf16) and `emulated` beside it;
  5. the executor calibration (fp8rl_core/fp8/calibrate.py), measured afresh: every CPU executor this machine
     runs on the calibration's shapes and on the Fp8Linear rows' M and K = N (FP32 x), ratio = time / the
     selected one's; the selected executor (what a run here selects: the cached calibration, else measured
     now) is marked, and the line above the table says whether it is the fastest row (or within the 15%
     margin of the default, which then stays).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fp8rl_core.fp8 import (  # noqa: E402
    Fp8Linear,
    calibrate,
    choice,
    cpu_features,
    dequantize_blockwise,
    fused_cpu,
    kernels,
    quantize_blockwise,
    select_executor,
)
from fp8rl_core.fp8.emulate import ieee_fp32_matmul  # noqa: E402
from fp8rl_core.fp8.quant import quantize_2d  # noqa: E402

CLOCK = time.perf_counter  # --clock cpu: time.process_time


def timeit(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Best-of-`repeats` time of fn() in seconds, after one warm-up call (gpu_check.py uses it)."""
    return best_times({"fn": fn}, repeats, device)["fn"]


def best_times(cases: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, float]:
    """Best-of-`repeats` wall time in seconds of each case, after one warm-up call of each. The cases
    take turns (one call of each per round), so that a change of load on a shared machine reaches
    every case alike and the ratios between them stay meaningful."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = {}
    for name, fn in cases.items():
        t0 = time.perf_counter()
        fn()
        sync()
        best[name] = float("inf")
        best["first call " + name] = time.perf_counter() - t0
    for _ in range(repeats):
        for name, fn in cases.items():
            t0 = CLOCK()
            fn()
            sync()
            best[name] = min(best[name], CLOCK() - t0)
    return best


def qdq_case(x: torch.Tensor, block: tuple[int, int], mode: str) -> Callable[[], torch.Tensor]:
    def qdq() -> torch.Tensor:
        with quantizer(mode):
            q, s = quantize_blockwise(x, block, check_finite=True)
            return dequantize_blockwise(q, s, block, out_dtype=torch.bfloat16)

    return qdq


def quant_rows(size: int, repeats: int, device: torch.device, modes: list[str]) -> list[tuple]:
    x = torch.randn(size, size, device=device).to(torch.bfloat16)
    buf = torch.empty_like(x)
    nbytes = 2 * x.numel() * x.element_size()
    cases: dict[str, Callable[[], object]] = {"copy": lambda: buf.copy_(x)}
    cases.update({f"{block} [{mode}]": qdq_case(x, block, mode) for mode in modes for block in ((1, 128), (128, 128))})
    t = best_times(cases, repeats, device)
    rows = [(f"copy bf16 {size}x{size} into a buffer", t["copy"], nbytes / t["copy"] / 1e9, 1.0, "", "baseline")]
    for name in list(cases)[1:]:
        note = f"first call {t['first call ' + name]:.1f}s" if "compiled" in name else ""
        rows.append((f"quant+dequant {name}", t[name], nbytes / t[name] / 1e9, t["copy"] / t[name], ">= 0.50", note))
    return rows


@contextlib.contextmanager
def quantizer(mode: str) -> Iterator[None]:
    """reference: pure-torch eager kernels; fused: the C kernel (CPU default); compiled: torch.compile."""
    old = os.environ.get(fused_cpu.ENV_OFF)
    os.environ[fused_cpu.ENV_OFF] = "0" if mode == "reference" else "1"
    kernels.set_compile(mode == "compiled")
    try:
        yield
    finally:
        kernels.set_compile(False)
        if old is None:
            os.environ.pop(fused_cpu.ENV_OFF)
        else:
            os.environ[fused_cpu.ENV_OFF] = old


def linear_rows(m: int, sizes: list[int], repeats: int, device: torch.device, executors: list[str],
                modes: list[str], with_bf16: bool) -> list[tuple]:
    rows = []
    for k in sizes:
        flops = 3 * 2 * m * k * k
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        ref32 = nn.Linear(k, k, device=device, dtype=torch.float32)
        x32, dy32 = x.detach().float().requires_grad_(), dy.float()
        fp8 = Fp8Linear.from_linear(ref32)  # FP32 master weights, BF16 activations: the training engine's case
        cases = {"fp32": step_case(ref32, x32, dy32)}
        if with_bf16:  # off by default: without AVX512-BF16/AMX, CPU BF16 GEMMs run ~20-35x slower than FP32
            cases["bf16"] = step_case(nn.Linear(k, k, device=device, dtype=torch.bfloat16), x, dy)
        cases.update({f"{name}, {mode}": step_case(fp8, x, dy, name, mode) for name in executors for mode in modes})
        # FP32 activations: model.dtype fp32, the study's setting on a CPU without BF16 hardware
        cases.update({f"{name}, {mode}, fp32 act": step_case(fp8, x32, dy32, name, mode) for name in executors
                      for mode in modes[1:]})
        t = best_times(cases, repeats, device)
        for name in cases:
            label = f"nn.Linear {name}" if name in ("fp32", "bf16") else f"Fp8Linear [{name}]"
            goal, note = ("", "floor (baseline)") if name == "fp32" else ("<= 1.25" if "," in name else "", "")
            rows.append((f"{label} fwd+bwd M={m} K=N={k}", t[name], flops / t[name] / 1e12, t[name] / t["fp32"],
                         goal, note))
    return rows


def step_case(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, executor: str | None = None,
              mode: str = "fused") -> Callable[[], None]:
    """One forward + backward of `layer`; an Fp8Linear re-quantizes its weight (as after an optimizer step)."""
    def step() -> None:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        if isinstance(layer, Fp8Linear):
            layer.invalidate()
        old = os.environ.get("FP8RL_GEMM")
        if executor:
            os.environ["FP8RL_GEMM"] = executor
        try:
            with quantizer(mode), ieee_fp32_matmul(x.device.type):
                layer(x).backward(dy)
        finally:
            os.environ.pop("FP8RL_GEMM", None) if old is None else os.environ.__setitem__("FP8RL_GEMM", old)

    return step


BF16_DOT = ("avx512_bf16", "amx_bf16")  # either gives the CPU BF16 dot products with FP32 accumulation


def cpu_paths_line() -> str:
    """What chose the CPU paths of the rows below: the kernel flags, the quantizer's path, the GEMM executor."""
    return (f"# cpu kernel flags: {cpu_features.kernel_flags()}; fused quantizer path: {fused_cpu.simd_path()}; "
            f"GEMM executor (cpu): {select_executor('cpu')}")


def fresh_output(shape: tuple[int, int]) -> torch.Tensor:
    """A new FP32 tensor advised onto huge pages (as fused_cpu.c advises its outputs) and written once: the
    least any function returning a fresh tensor of this size pays (page faults, the kernel's zeroing, stores)."""
    t = torch.empty(shape)
    huge, p = 1 << 21, t.data_ptr()
    a, b = -(-p // huge) * huge, (p + t.numel() * 4) // huge * huge
    if b > a and hasattr(mmap, "MADV_HUGEPAGE"):
        ctypes.CDLL(None).madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), mmap.MADV_HUGEPAGE)
    return t.fill_(0.0)


def qdq_fp32_rows(size: int, repeats: int) -> list[tuple]:
    """Issue 25 (a): copy / (quantize + dequantize) of an FP32 size x size tensor, the fused kernel."""
    x = torch.randn(size, size)
    buf = torch.empty_like(x)
    path = fused_cpu.simd_path()
    note = f"path {path} ({' '.join(fused_cpu.PATH_NEEDS.get(path or '', ())) or 'no vector flags'})"
    goal = {"avx512": ">= 0.50", "avx2": "~0.29"}.get(path or "", "")
    cases: dict[str, Callable[[], object]] = {"copy": lambda: buf.copy_(x)}
    for block in ((1, 128), (128, 128)):
        q, s = quantize_blockwise(x, block)
        cases[f"q {block}"] = qdq_part(lambda block=block: quantize_blockwise(x, block))
        cases[f"dq {block}"] = qdq_part(lambda block=block, q=q, s=s: dequantize_blockwise(q, s, block))
    cases["deq only"] = qdq_part(lambda: quantize_2d(x, (1, 128), power_of_two=False, check_finite=True, name="x",
                                                     want_dequant=True, want_q=False))
    cases["fresh"] = lambda: fresh_output((size, size))
    t = best_times(cases, repeats, torch.device("cpu"))
    nbytes, shape = 2 * x.numel() * 4, f"fp32 {size}x{size}"
    rows = [(f"copy {shape} into a buffer", t["copy"], nbytes / t["copy"] / 1e9, 1.0, "", "baseline")]
    for block in ((1, 128), (128, 128)):
        both = t[f"q {block}"] + t[f"dq {block}"]
        rows += [(f"quantize {block} {shape} -> e4m3", t[f"q {block}"], nbytes / t[f"q {block}"] / 1e9,
                  t["copy"] / t[f"q {block}"], "", note),
                 (f"dequantize {block} e4m3 -> {shape}", t[f"dq {block}"], nbytes / t[f"dq {block}"] / 1e9,
                  t["copy"] / t[f"dq {block}"], "", note),
                 (f"quantize + dequantize {block} {shape}", both, nbytes / both / 1e9, t["copy"] / both, goal, note)]
    rows += [(f"quantize (1, 128) {shape} -> fp32 dequantized only", t["deq only"], nbytes / t["deq only"] / 1e9,
              t["copy"] / t["deq only"], "", "the emulated GEMM's activations"),
             (f"floor: a fresh {shape} output written", t["fresh"], nbytes / t["fresh"] / 1e9, t["copy"] / t["fresh"],
              "", "huge-page-advised; dequantize's least")]
    return rows


def qdq_part(fn: Callable[[], object]) -> Callable[[], object]:
    """fn with the fused kernel on (whatever FP8RL_FUSED says)."""
    def run() -> object:
        with quantizer("fused"):
            return fn()

    return run


def bf16_linear_rows(m: int, sizes: list[int], repeats: int, threads: list[int]) -> list[tuple]:
    """Issue 25 (b): Fp8Linear fwd+bwd / nn.Linear BF16 fwd+bwd on the CPU, the selected executor and emulated."""
    selected, old = select_executor("cpu"), torch.get_num_threads()
    dot = [f for f in BF16_DOT if cpu_features.has(f)]
    goal, flags = ("<= 1.00" if dot else ""), " ".join(dot) or "no BF16 dot products"
    rows = []
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for k in sizes:
                x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
                dy = torch.randn(m, k, dtype=torch.bfloat16)
                fp8 = Fp8Linear.from_linear(nn.Linear(k, k))  # FP32 master weights, as in training
                cases = {"bf16": step_case(nn.Linear(k, k, dtype=torch.bfloat16), x, dy)}
                cases.update({name: step_case(fp8, x, dy, name) for name in dict.fromkeys([selected, "emulated"])})
                t = best_times(cases, repeats, torch.device("cpu"))
                flops, where = 3 * 2 * m * k * k, f"M={m} K=N={k} {n_threads}T"
                rows.append((f"nn.Linear bf16 fwd+bwd {where}", t["bf16"], flops / t["bf16"] / 1e12, 1.0, "",
                             f"baseline ({flags})"))
                rows += [(f"Fp8Linear [{name}] fwd+bwd {where}", t[name], flops / t[name] / 1e12,
                          t[name] / t["bf16"], goal if name == selected else "",
                          f"{'selected' if name == selected else 'for comparison'} ({flags})")
                         for name in cases if name != "bf16"]
    finally:
        torch.set_num_threads(old)
    return rows


def calibration_rows(m: int, sizes: list[int], repeats: int, selected: str) -> tuple[list[tuple], str]:
    """Issue 35: each CPU executor on the calibration's shapes (as a run measures them) and at M x K = N, FP32 x;
    (rows, a line naming the fastest and whether it is the selected one)."""
    names = calibrate.candidates()
    default = names[0]
    measured = calibrate.measure(names)
    mark = {n: ("selected" if n == selected else "") + (" default" if n == default else "") for n in names}
    cal_flops = sum(3 * 2 * mm * k * n for mm, k, n in calibrate.SHAPES)
    rows = [(f"executor [{n}] calibration (calibrate.SHAPES)", measured[n], cal_flops / measured[n] / 1e12,
             measured[n] / measured[selected], "", mark[n].strip() or "for comparison") for n in measured]
    for k in sizes:
        x = torch.randn(m, k, requires_grad=True)
        dy = torch.randn(m, k)
        fp8 = Fp8Linear.from_linear(nn.Linear(k, k))
        t = best_times({n: step_case(fp8, x, dy, n) for n in names}, repeats, torch.device("cpu"))
        flops = 3 * 2 * m * k * k
        rows += [(f"executor [{n}] fwd+bwd M={m} K=N={k} fp32 x", t[n], flops / t[n] / 1e12,
                  t[n] / t[selected], "", mark[n].strip() or "for comparison") for n in names]
    fastest = min(measured, key=measured.__getitem__)
    speedup = measured[default] / measured[fastest]
    verdict = ("the selected executor is the fastest" if fastest == selected else
               f"the fastest is {fastest}, {speedup:.2f}x the default's speed: under the margin "
               f"{1 + calibrate.MARGIN:.2f}x, so the default {default} stays" if selected == default else
               f"the fastest now is {fastest}, not the selected {selected} (cached calibration; delete "
               f"{calibrate.cache_dir()} to measure again)")
    shapes = ", ".join(f"M={mm} {k}->{n}" for mm, k, n in calibrate.SHAPES)
    line = (f"# executor calibration: CPU {calibrate.cpu_model()}, kernel flags {cpu_features.kernel_flags()}; "
            f"shapes {shapes}; candidates {', '.join(names)}; default {default}; "
            f"selected {selected} (margin {calibrate.MARGIN:.0%}); "
            f"{verdict}")
    return rows, line


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (1024^2 quantize, M=1024, K=N in 256,1024)")
    ap.add_argument("--compile", choices=("off", "on"), default="off", help="add torch.compile'd quantizer rows")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--executors", default=None, help="comma list; default: the selected one (+ emulated on CUDA)")
    ap.add_argument("--tokens", type=int, default=None, help="M of the linear rows")
    ap.add_argument("--sizes", default=None, help="comma list of K = N for the linear rows")
    ap.add_argument("--no-quant", action="store_true", help="skip the quantize+dequantize rows")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--bf16", action="store_true", help="add nn.Linear BF16 rows on the CPU (slow without AVX512-BF16)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time (with --threads 1, the compute time on a shared machine)")
    ap.add_argument("--only", choices=("cpu-paths",), default=None,
                    help="cpu-paths: only the CPU path rows (FP32 quantize+dequantize, Fp8Linear vs BF16 nn.Linear)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    size, m, sizes = (1024, 1024, [256, 1024]) if args.quick else (4096, 2048, [256, 1024])
    m = args.tokens or m
    sizes = [int(v) for v in args.sizes.split(",")] if args.sizes else sizes
    if device.type == "cpu" and not os.environ.get("FP8RL_GEMM"):
        settled = choice.settle_executor("auto", device)  # what a run here selects (calibrate.py)
        print(f"# FP8 GEMM executor selected as a run here would: {settled.executor} ({settled.how})")
    executors = args.executors.split(",") if args.executors else [select_executor(device)]
    if device.type == "cuda" and "emulated" not in executors:
        executors.append("emulated")
    modes = ["reference", "fused"] + (["compiled"] if args.compile == "on" else [])
    load0 = os.getloadavg()
    print(f"# torch {torch.__version__}, device {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{torch.get_num_threads()} threads'}), "
          f"{args.clock} clock")
    rows: list[tuple] = []
    if args.only is None:
        rows += [] if args.no_quant else quant_rows(size, args.repeats, device, modes)
        rows += linear_rows(m, sizes, args.repeats, device, executors, modes[:2], args.bf16 or device.type == "cuda")
    if device.type == "cpu":
        print(cpu_paths_line())
        rows += [] if args.no_quant else qdq_fp32_rows(size, args.repeats)
        if args.bf16 or any(cpu_features.has(f) for f in BF16_DOT):
            rows += bf16_linear_rows(m, sizes, args.repeats, sorted({1, torch.get_num_threads()}))
        else:
            print(f"# Fp8Linear vs BF16 nn.Linear rows skipped: no {' or '.join(BF16_DOT)} here (--bf16 runs them)")
        if not os.environ.get("FP8RL_GEMM"):
            cal_rows, cal_line = calibration_rows(m, sizes, args.repeats, select_executor(device))
            rows += cal_rows
            print(cal_line)
    print(f"| {'case':<58} | {'time ms':>9} | {'GB/s or TFLOP/s':>15} | {'ratio':>6} | {'goal':>7} | note")
    print(f"|{'-' * 60}|{'-' * 11}|{'-' * 17}|{'-' * 8}|{'-' * 9}|-----")
    for name, t, rate, ratio, goal, note in rows:
        print(f"| {name:<58} | {t * 1e3:9.1f} | {rate:15.3f} | {ratio:6.2f} | {goal:>7} | {note}")
    print(f"# load average (1, 5, 15 min): before {tuple(round(v, 2) for v in load0)}, "
          f"after {tuple(round(v, 2) for v in os.getloadavg())} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
