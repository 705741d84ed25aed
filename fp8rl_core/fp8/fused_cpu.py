"""The fused CPU quantizer (fused_cpu.c): built once per machine with the system C compiler, cached on
disk, loaded through ctypes. Bit-identical to the reference kernels in kernels.py (tested on every
block shape, dtype and scale mode); the reference runs instead wherever this one does not apply.

Why a small C file and not torch.compile: the eager reference makes ~8 passes over memory and decodes
float8 at ~12 ns/element here (torch's CPU float8 casts are scalar), and Inductor's code keeps the
float8 casts and two passes (measured ~9 GB/s at 1024^2). One C loop per block-row reads x once
(the block's amax and its quantization share the cache), rounds to E4M3 with FP32 bit arithmetic,
and writes q, the scales and the FP32 dequantized copy in the same pass. Where the compiler targets
AVX2 the inner loops are written with its intrinsics (8 lanes; gcc's own vectorization of the scalar
loops spilled registers and stored bytes one lane at a time: 2x slower), step for step the scalar
arithmetic, which still runs the row tails and every other CPU; large
fresh outputs are advised onto transparent huge pages (first-touch page faults cost more than the
kernel itself at 4096^2). It builds in ~1-15 s with gcc (no torch headers: plain C through ctypes),
against ~35 s of Inductor compile, once per machine.

Applies to: CPU tensors, FP32/BF16 input, 2-D, nonempty, all blocks finite (otherwise the reference
runs and raises or propagates NaN/inf exactly as before). Env: FP8RL_FUSED=0 turns it off;
FP8RL_KERNEL_CACHE=<dir> moves the cache (default ~/.cache/fp8rl/kernels). The cache key hashes the
source, the flags, the compiler's version and this CPU's model and flags (-march=native), so a node
of another CPU type builds its own copy; concurrent builders write a temporary file and rename it.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("fused_cpu.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fPIC", "-shared")
ENV_OFF, ENV_CACHE = "FP8RL_FUSED", "FP8RL_KERNEL_CACHE"
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_c_i64, _c_ptr = ctypes.c_int64, ctypes.c_void_p


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1") not in ("0", "false", "False", "")


def _cpu_id() -> str:
    """This CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))


def _compile(cc: str, out: Path, openmp: bool, extra: tuple[str, ...]) -> None:
    cmd = [cc, *FLAGS, *extra, *(["-fopenmp"] if openmp else []), "-o", str(out), str(SOURCE)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def build(cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library's path, building it (about a second) only if the cache lacks it.
    extra_flags: appended to FLAGS (tests build the portable scalar code with ("-mno-avx2",))."""
    cc = os.environ.get("CC", "cc")
    version = subprocess.run([cc, "--version"], check=True, capture_output=True, text=True).stdout
    flags = " ".join(FLAGS + tuple(extra_flags))
    key = hashlib.sha256("\0".join([SOURCE.read_text(), flags, version, _cpu_id()]).encode())
    folder = Path(cache_dir or os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "fp8rl" / "kernels")
    lib = folder / f"fused_cpu-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        try:
            _compile(cc, Path(tmp), openmp=True, extra=tuple(extra_flags))
        except subprocess.CalledProcessError:  # a compiler without OpenMP: single-threaded kernels
            _compile(cc, Path(tmp), openmp=False, extra=tuple(extra_flags))
        os.replace(tmp, lib)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (with one warning) where no C compiler works."""
    try:
        return load(build())
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
    return lib


def _usable(t: torch.Tensor, dtypes, lib: ctypes.CDLL | None) -> ctypes.CDLL | None:
    if t.device.type != "cpu" or t.dtype not in dtypes or t.dim() != 2 or t.numel() == 0 or not enabled():
        return None
    return lib or library()


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
    return None if bad else (q, scale, deq)


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
    return None if bad else out
