"""Build a C kernel file of this package once per machine with the system compiler, cache the shared
library on disk, and load it through ctypes (fused_cpu.c, cpu_gemm.c).

The cache key hashes the source, the flags, the compiler's version and this CPU's model and flags
(-march=native decides which instruction paths are compiled), so a node of another CPU type builds its
own copy; concurrent builders write a temporary file and rename it. FP8RL_KERNEL_CACHE=<dir> moves the
cache (default ~/.cache/fp8rl/kernels). Plain C, no torch headers: a build takes ~1-15 s with gcc.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fPIC", "-shared")
ENV_CACHE = "FP8RL_KERNEL_CACHE"


def cpu_id() -> str:
    """This CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))


def _compile(cc: str, source: Path, out: Path, openmp: bool, extra: tuple[str, ...]) -> None:
    cmd = [cc, *FLAGS, *extra, *(["-fopenmp"] if openmp else []), "-o", str(out), str(source)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def build(source: Path, cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library of `source`, building it only if the cache lacks it. extra_flags: appended to
    FLAGS (tests build the portable code of a file with e.g. ("-mno-avx2",))."""
    cc = os.environ.get("CC", "cc")
    version = subprocess.run([cc, "--version"], check=True, capture_output=True, text=True).stdout
    flags = " ".join(FLAGS + tuple(extra_flags))
    key = hashlib.sha256("\0".join([source.read_text(), flags, version, cpu_id()]).encode())
    folder = Path(cache_dir or os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "fp8rl" / "kernels")
    lib = folder / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        try:
            _compile(cc, source, Path(tmp), openmp=True, extra=tuple(extra_flags))
        except subprocess.CalledProcessError:  # a compiler without OpenMP: single-threaded kernels
            _compile(cc, source, Path(tmp), openmp=False, extra=tuple(extra_flags))
        os.replace(tmp, lib)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
