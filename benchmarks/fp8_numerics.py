"""Usage: python benchmarks/fp8_numerics.py [--quick] [--compile off|on|both] [--device cpu|cuda] [--repeats N]
                                         [--executors a,b] [--tokens M] [--sizes 1024,4096] [--no-quant]

Blockwise-FP8 numerics speed, every number measured in this one run against a baseline of the same run:
  1. quantize + dequantize of an M x M BF16 tensor, blocks (1,128) and (128,128), vs a plain copy of
     the same bytes (effective GB/s = 2 * bytes(x) / time; goal: ratio >= 0.3 of the copy);
  2. Fp8Linear forward + backward vs BF16 nn.Linear at M tokens, K = N in a list (goal on CPU <= 2x
     the BF16 time; on CUDA >= 1.5x faster), with TFLOP/s (3 GEMMs of 2*M*N*K each).
--compile on runs the quantization kernels through torch.compile (the compile time is reported).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fp8rl_core.fp8 import Fp8Linear, dequantize_blockwise, kernels, quantize_blockwise, select_executor  # noqa: E402


def timeit(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Best-of-`repeats` wall time of fn() in seconds, after one warm-up call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def quant_rows(size: int, repeats: int, device: torch.device, mode: str) -> list[tuple]:
    x = torch.randn(size, size, device=device).to(torch.bfloat16)
    buf = torch.empty_like(x)
    nbytes = 2 * x.numel() * x.element_size()
    t_copy = timeit(lambda: buf.copy_(x), repeats, device)
    t_clone = timeit(lambda: x.clone(), repeats, device)
    rows = [(f"copy bf16 {size}x{size} into a buffer", t_copy, nbytes / t_copy / 1e9, 1.0, "baseline"),
            (f"clone bf16 {size}x{size} (fresh memory)", t_clone, nbytes / t_clone / 1e9, t_copy / t_clone, "")]
    for block in ((1, 128), (128, 128)):
        def qdq() -> torch.Tensor:
            q, s = quantize_blockwise(x, block, check_finite=True)
            return dequantize_blockwise(q, s, block, out_dtype=torch.bfloat16)

        t0 = time.perf_counter()
        qdq()
        first = time.perf_counter() - t0
        t = timeit(qdq, repeats, device)
        note = f"first call {first:.1f}s" if mode == "compiled" else ""
        rows.append((f"quant+dequant {block} [{mode}]", t, nbytes / t / 1e9, t_copy / t, note))
    return rows


def linear_rows(m: int, sizes: list[int], repeats: int, device: torch.device, executors: list[str]) -> list[tuple]:
    rows = []
    for k in sizes:
        flops = 3 * 2 * m * k * k
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        ref = nn.Linear(k, k, device=device, dtype=torch.bfloat16)

        def step(layer: nn.Module) -> None:
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(x).backward(dy)

        t_ref = timeit(lambda: step(ref), repeats, device)
        rows.append((f"nn.Linear bf16 fwd+bwd M={m} K=N={k}", t_ref, flops / t_ref / 1e12, 1.0, ""))
        fp8 = Fp8Linear.from_linear(ref)
        for name in executors:
            os.environ["FP8RL_GEMM"] = name
            t = timeit(lambda: step(fp8), repeats, device)
            rows.append((f"Fp8Linear fwd+bwd M={m} K=N={k} [{name}]", t, flops / t / 1e12, t / t_ref, "ratio = time / bf16 time"))
        os.environ.pop("FP8RL_GEMM", None)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (1024^2 quantize, M=1024, K=N in 256,1024)")
    ap.add_argument("--compile", choices=("off", "on", "both"), default="both")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--executors", default=None, help="comma list; default: the selected one (+ emulated on CUDA)")
    ap.add_argument("--tokens", type=int, default=None, help="M of the linear rows")
    ap.add_argument("--sizes", default=None, help="comma list of K = N for the linear rows")
    ap.add_argument("--no-quant", action="store_true", help="skip the quantize+dequantize rows")
    args = ap.parse_args()
    device = torch.device(args.device)
    size, m, sizes = (1024, 1024, [256, 1024]) if args.quick else (4096, 4096, [1024, 4096])
    m = args.tokens or m
    sizes = [int(v) for v in args.sizes.split(",")] if args.sizes else sizes
    executors = args.executors.split(",") if args.executors else [select_executor(device)]
    if device.type == "cuda" and "emulated" not in executors:
        executors.append("emulated")
    print(f"# torch {torch.__version__}, device {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{torch.get_num_threads()} threads'})")
    rows: list[tuple] = []
    modes = ["eager", "compiled"] if args.compile == "both" else ["compiled" if args.compile == "on" else "eager"]
    for mode in [] if args.no_quant else modes:
        kernels.set_compile(mode == "compiled")
        rows += quant_rows(size, args.repeats, device, mode)
    kernels.set_compile(modes[-1] == "compiled")
    rows += linear_rows(m, sizes, args.repeats, device, executors)
    print(f"| {'case':<52} | {'time ms':>9} | {'GB/s or TFLOP/s':>15} | {'ratio':>6} | note")
    print(f"|{'-' * 54}|{'-' * 11}|{'-' * 17}|{'-' * 8}|-----")
    for name, t, rate, ratio, note in rows:
        print(f"| {name:<52} | {t * 1e3:9.1f} | {rate:15.3f} | {ratio:6.2f} | {note}")


if __name__ == "__main__":
    main()
