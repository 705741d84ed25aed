"""The fused CPU quantizer (fused_cpu.c): built once per machine with the system C compiler, cached on
disk (cbuild.py), loaded through ctypes. Bit-identical to the reference kernels in kernels.py (tested on
every block shape, dtype and scale mode, on each vector path); the reference runs instead wherever this
one does not apply.

Why a small C file and not torch.compile: the eager reference makes ~8 passes over memory and decodes
float8 at ~12 ns/element here (torch's CPU float8 casts are scalar), and Inductor's code keeps the
float8 casts and two passes (measured ~9 GB/s at 1024^2). One C loop per block-row panel reads x once
from DRAM (the block's amax and its quantization share the cache), rounds to E4M3 with FP32 bit
arithmetic, and writes q, the scales and the FP32 dequantized copy in the same pass; large fresh outputs
are advised onto transparent huge pages (first-touch page faults cost more than the kernel itself at
4096^2). It builds in ~1-15 s with gcc (no torch headers), against ~35 s of Inductor compile.

Vector paths (`simd_path()`; chosen at compile time by -march=native, i.e. this CPU's flags):
  "avx512"  AVX-512 F/BW/VL, 16 lanes, masked row tails, streamed codes for large tensors. Quantizing is
            bound by one core's DRAM bandwidth (in L2 by vdivps; power-of-two scales multiply instead,
            exactly), dequantizing by the fresh tensor it returns (timings: docs/design.md section 9).
  "avx2"    8 lanes with AVX2 intrinsics (gcc's own vectorization of the scalar loops spilled registers
            and stored bytes one lane at a time: about 2x slower), scalar row tails.
  "scalar"  the portable C loops, for every other CPU.
Each path is step for step the same arithmetic (the same FP32 division, clamp and ties-to-even
rounding), so the bits do not depend on the CPU. FP8RL_CPU_FLAGS_OFF="avx512f" (or "avx2") builds the
slower paths on a faster CPU (cpu_features.py).

Applies to: CPU tensors, FP32/BF16 input, 2-D, nonempty, all blocks finite (otherwise the reference
runs and raises or propagates NaN/inf exactly as before). Env: FP8RL_FUSED=0 turns it off;
FP8RL_KERNEL_CACHE=<dir> moves the cache (default ~/.cache/fp8rl/kernels). The cache key hashes the
source and its header, the flags, the compiler's version and this CPU's model and flags (-march=native), so a node
of another CPU type builds its own copy; concurrent builders write a temporary file and rename it.
The codes passed to and returned by the C functions come from fp8rl_kernels.h (cbuild.constants).
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import subprocess
import warnings
from pathlib import Path

import torch

from fp8rl_core.fp8 import cbuild, cpu_features

SOURCE = Path(__file__).with_name("fused_cpu.c")
FLAGS = cbuild.FLAGS
ENV_OFF, ENV_CACHE = "FP8RL_FUSED", cbuild.ENV_CACHE
_H = cbuild.constants()
_DTYPE_CODE = {torch.float32: _H["FP8RL_DTYPE_F32"], torch.bfloat16: _H["FP8RL_DTYPE_BF16"]}
_c_i64, _c_ptr = ctypes.c_int64, ctypes.c_void_p
# the vector paths (fp8rl_simd_path's codes), the flags each needs, and the gcc options that switch each off
SIMD_PATHS = {_H["FP8RL_SIMD_AVX512"]: "avx512", _H["FP8RL_SIMD_AVX2"]: "avx2", _H["FP8RL_SIMD_SCALAR"]: "scalar"}
PATH_NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2",), "scalar": ()}
PATH_FLAGS = {"avx512": (), "avx2": ("-mno-avx512f",), "scalar": ("-mno-avx2",)}
# each path as a target of its own (on -march=x86-64): the -Werror builds compile every one on any x86 CPU
TARGETS = {"avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl"), "avx2": ("-mavx2", "-mfma"), "scalar": ()}


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1") not in ("0", "false", "False", "")


def build(cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library's path, building it (a few seconds) only if the cache lacks it (cbuild.py).
    extra_flags: appended to FLAGS (tests build the AVX2 and portable paths with PATH_FLAGS)."""
    return cbuild.build(SOURCE, cache_dir, tuple(extra_flags))


def default_flags() -> tuple[str, ...]:
    """The options that keep the default build off a vector path whose flags $FP8RL_CPU_FLAGS_OFF hides
    (x86 only; -march=native already leaves out what the CPU lacks)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    hidden = set(os.environ.get(cpu_features.ENV_OFF, "").replace(",", " ").split())
    if hidden & set(PATH_NEEDS["avx2"]):
        return PATH_FLAGS["scalar"]
    return PATH_FLAGS["avx2"] if hidden & set(PATH_NEEDS["avx512"]) else ()


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (with one warning) where no C compiler works."""
    try:
        return load(build(extra_flags=default_flags()))
    except (OSError, subprocess.SubprocessError) as err:
        warnings.warn(f"fp8rl: fused CPU FP8 kernels unavailable ({err}); using the pure-torch ones", stacklevel=2)
        return None


def load(path: Path) -> ctypes.CDLL:
    """A built library (see build) with its functions' C signatures declared."""
    lib = ctypes.CDLL(str(path))
    lib.fp8rl_quantize.restype = ctypes.c_int
    lib.fp8rl_quantize.argtypes = [_c_ptr, ctypes.c_int, _c_i64, _c_i64, _c_i64, _c_i64, ctypes.c_int,
                                   _c_ptr, _c_ptr, _c_ptr, _c_ptr, ctypes.c_int]
    lib.fp8rl_dequantize.restype = ctypes.c_int
    lib.fp8rl_dequantize.argtypes = [_c_ptr, _c_ptr, _c_i64, _c_i64, _c_i64, _c_i64, _c_ptr, ctypes.c_int,
                                     ctypes.c_int]
    lib.fp8rl_simd_path.restype = ctypes.c_int
    lib.fp8rl_simd_path.argtypes = []
    return lib


def simd_path(lib: ctypes.CDLL | None = None) -> str | None:
    """The vector path a build runs: "avx512" (16 lanes), "avx2" (8 lanes) or "scalar" (portable C), decided
    at compile time by -march=native (this CPU's flags, less $FP8RL_CPU_FLAGS_OFF); None where no build works.
    lib: another build (see load) instead of this machine's default one."""
    lib = lib or library()
    return None if lib is None else SIMD_PATHS[lib.fp8rl_simd_path()]


def _usable(t: torch.Tensor, dtypes, lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    if t.device.type != "cpu" or t.dtype not in dtypes or t.dim() != 2 or t.numel() == 0 or not enabled():
        return None
    return lib or library()


@torch.compiler.disable  # ctypes writes through data pointers: Dynamo must not trace it (heap corruption)
def quantize(x2: torch.Tensor, block: tuple[int, int], power_of_two: bool, want_dequant: bool,
             lib: ctypes.CDLL | None = None, want_q: bool = True
             ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None] | None:
    """kernels.quantize_blocks on x2 [M, N] unblocked: (q E4M3 [M, N] or None (want_q False), scale FP32
    [Mb, Nb], deq FP32 [M, N] or None), or None where the fused kernel does not apply (the caller runs
    the reference). lib: another build of the kernels (see load) instead of this machine's default one."""
    lib = _usable(x2, _DTYPE_CODE, lib)
    if lib is None:
        return None
    x2 = x2.contiguous()
    (m, n), (br, bc) = x2.shape, block
    mb, nb = -(-m // br), -(-n // bc)
    threads = max(1, min(torch.get_num_threads(), mb))
    q = torch.empty((m, n), dtype=torch.float8_e4m3fn) if want_q or not want_dequant else None
    scale = torch.empty((mb, nb), dtype=torch.float32)
    deq = torch.empty((m, n), dtype=torch.float32) if want_dequant else None
    work = torch.empty(threads * nb, dtype=torch.int32)
    bad = lib.fp8rl_quantize(x2.data_ptr(), _DTYPE_CODE[x2.dtype], m, n, br, bc, int(power_of_two),
                             None if q is None else q.data_ptr(), scale.data_ptr(),
                             None if deq is None else deq.data_ptr(),
                             work.data_ptr(), threads)
    return None if bad == _H["FP8RL_DECLINED"] else (q, scale, deq)


@torch.compiler.disable  # ctypes writes through data pointers: Dynamo must not trace it (heap corruption)
def dequantize(q2: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype,
               lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """kernels.dequantize_blocks on q2 [M, N] unblocked -> [M, N] in out_dtype, or None (not applicable,
    or q holds a NaN code: the reference then decodes it)."""
    lib = _usable(q2, (torch.float8_e4m3fn,), lib)
    if lib is None or out_dtype not in _DTYPE_CODE or scale.device.type != "cpu":
        return None
    q2, scale = q2.contiguous(), scale.float().contiguous()
    (m, n), (br, bc) = q2.shape, block
    out = torch.empty((m, n), dtype=out_dtype)
    threads = max(1, min(torch.get_num_threads(), m))
    bad = lib.fp8rl_dequantize(q2.data_ptr(), scale.data_ptr(), m, n, br, bc, out.data_ptr(),
                               _DTYPE_CODE[out_dtype], threads)
    return None if bad == _H["FP8RL_DECLINED"] else out
