"""Usage: python benchmarks/fp8_numerics.py [--quick] [--compile off|on] [--device cpu|cuda] [--repeats N]
                                         [--executors a,b] [--tokens M] [--sizes 256,1024] [--no-quant]
                                         [--threads N] [--bf16] [--clock wall|cpu]

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
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fp8rl_core.fp8 import Fp8Linear, dequantize_blockwise, fused_cpu, kernels, quantize_blockwise, select_executor  # noqa: E402
from fp8rl_core.fp8.emulate import ieee_fp32_matmul  # noqa: E402

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


def main() -> None:
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
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    size, m, sizes = (1024, 1024, [256, 1024]) if args.quick else (4096, 2048, [256, 1024])
    m = args.tokens or m
    sizes = [int(v) for v in args.sizes.split(",")] if args.sizes else sizes
    executors = args.executors.split(",") if args.executors else [select_executor(device)]
    if device.type == "cuda" and "emulated" not in executors:
        executors.append("emulated")
    modes = ["reference", "fused"] + (["compiled"] if args.compile == "on" else [])
    load0 = os.getloadavg()
    print(f"# torch {torch.__version__}, device {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{torch.get_num_threads()} threads'}), "
          f"{args.clock} clock")
    rows: list[tuple] = [] if args.no_quant else quant_rows(size, args.repeats, device, modes)
    rows += linear_rows(m, sizes, args.repeats, device, executors, modes[:2], args.bf16 or device.type == "cuda")
    print(f"| {'case':<58} | {'time ms':>9} | {'GB/s or TFLOP/s':>15} | {'ratio':>6} | {'goal':>7} | note")
    print(f"|{'-' * 60}|{'-' * 11}|{'-' * 17}|{'-' * 8}|{'-' * 9}|-----")
    for name, t, rate, ratio, goal, note in rows:
        print(f"| {name:<58} | {t * 1e3:9.1f} | {rate:15.3f} | {ratio:6.2f} | {goal:>7} | {note}")
    print(f"# load average (1, 5, 15 min): before {tuple(round(v, 2) for v in load0)}, "
          f"after {tuple(round(v, 2) for v in os.getloadavg())} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
