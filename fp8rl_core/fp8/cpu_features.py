"""The CPU instructions that pick the CPU kernels' paths, read once from /proc/cpuinfo (Linux; elsewhere empty).

The flags that matter here (Linux spellings):
  avx2          the fused quantizer's 8-lane path (fused_cpu.c)
  avx512f, avx512bw, avx512vl   its 16-lane path
  avx512_bf16   VDPBF16PS: BF16 dot products with FP32 accumulation (cpu_gemm.c)
  amx_tile, amx_bf16            AMX TDPBF16PS tiles (cpu_gemm.c; the OS must grant tile state)
`FP8RL_CPU_FLAGS_OFF="amx_bf16 avx512_bf16"` hides flags (to run and test the slower paths on a fast CPU).
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

KERNEL_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16")
ENV_OFF = "FP8RL_CPU_FLAGS_OFF"


@functools.cache
def proc_flags() -> frozenset[str]:
    """This CPU's feature flags as the OS lists them (the `flags` line of /proc/cpuinfo on x86, `Features`
    on Arm; empty where unreadable). The one place the project reads them (model/bf16.py too)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """proc_flags(), less those named in $FP8RL_CPU_FLAGS_OFF (the kernels' paths read these)."""
    hidden = set(os.environ.get(ENV_OFF, "").replace(",", " ").split())
    return proc_flags() - hidden


def has(*flags: str) -> bool:
    return all(f in cpu_flags() for f in flags)


def missing(*flags: str) -> list[str]:
    """The flags of `flags` this CPU lacks (for skip reasons and log lines)."""
    return [f for f in flags if f not in cpu_flags()]


def kernel_flags() -> str:
    """The kernel-relevant flags present, e.g. 'avx2 avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16'."""
    have = cpu_flags()
    return " ".join(f for f in KERNEL_FLAGS if f in have) or "none"
