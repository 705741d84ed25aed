"""Build a C kernel file of this package once per machine with the system compiler, cache the shared
library on disk, and load it through ctypes (fused_cpu.c, cpu_gemm.c).

The cache key hashes the source, the headers beside it (fp8rl_kernels.h: the kernels' signatures and
argument / return codes, which the wrappers read through `constants`), the flags, the compiler's version
and this CPU's model and flags (-march=native decides which instruction paths are compiled), so a node of
another CPU type builds its own copy; concurrent builders write a temporary file and rename it.
FP8RL_KERNEL_CACHE=<dir> moves the cache (default ~/.cache/fp8rl/kernels). FP8RL_KERNEL_SANITIZE=1 builds
with AddressSanitizer + UBSan (SANITIZE_FLAGS; the process must preload their runtimes, `sanitizer_preload`).
`check_warnings` compiles a file for one target with -Wall -Wextra -Werror (CI: every SIMD path the compiler
knows, whatever this CPU runs). Plain C, no torch headers: a build takes a few seconds with gcc.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fPIC", "-shared")
ENV_CACHE = "FP8RL_KERNEL_CACHE"
ENV_SANITIZE = "FP8RL_KERNEL_SANITIZE"
HEADER = Path(__file__).with_name("fp8rl_kernels.h")
SANITIZE_FLAGS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer")
# the warning builds: FLAGS for a named target instead of this CPU (compiling needs no such CPU)
WARNING_FLAGS = ("-Wall", "-Wextra", "-Werror")
_DEFINE = re.compile(r"^#define\s+(FP8RL_\w+)\s+(\d+)\b", re.MULTILINE)


@functools.cache
def constants(header: Path = HEADER) -> dict[str, int]:
    """The integer #defines named FP8RL_* in `header` ({"FP8RL_DTYPE_BF16": 1, ...}): the one definition of
    the kernels' argument and return codes, read by the wrappers at import."""
    return {name: int(value) for name, value in _DEFINE.findall(header.read_text())}


def sanitizing() -> bool:
    """Whether builds add SANITIZE_FLAGS ($FP8RL_KERNEL_SANITIZE=1)."""
    return os.environ.get(ENV_SANITIZE, "0") not in ("0", "false", "False", "")


def sanitizer_preload(cc: str | None = None) -> str:
    """LD_PRELOAD for a process that loads a sanitized build: the compiler's ASan and UBSan runtimes (ASan
    must come first in the process, and python itself is not linked against it)."""
    cc = cc or os.environ.get("CC", "cc")
    libs = [subprocess.run([cc, f"-print-file-name={name}"], check=True, capture_output=True, text=True).stdout.strip()
            for name in ("libasan.so", "libubsan.so")]
    return " ".join(libs)


def check_warnings(source: Path, out_dir: Path, target: tuple[str, ...], defines: tuple[str, ...] = ()) -> None:
    """Compile `source` for `target` (e.g. ("-march=x86-64", "-mavx2")) with WARNING_FLAGS and OpenMP into
    out_dir; raises CalledProcessError with the compiler's messages on any warning."""
    cc = os.environ.get("CC", "cc")
    flags = [f for f in FLAGS if f != "-march=native"]
    cmd = [cc, *flags, *WARNING_FLAGS, *target, *defines, "-fopenmp", "-o", str(out_dir / f"{source.stem}.so"),
           str(source)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)


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


def library_path(source: Path, folder: Path, extra_flags: tuple[str, ...], cc: str) -> Path:
    """Where the build of `source` with FLAGS + extra_flags by `cc` is cached in `folder`: the file name holds
    sha256(source, the headers beside it, flags, compiler version, cpu_id()), so a change to any rebuilds."""
    version = subprocess.run([cc, "--version"], check=True, capture_output=True, text=True).stdout
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(FLAGS + extra_flags), version,
                                     cpu_id()]).encode())
    return folder / f"{source.stem}-{key.hexdigest()[:16]}.so"


def build(source: Path, cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled library of `source`, building it only if the cache lacks it. extra_flags: appended to
    FLAGS (tests build the portable code of a file with e.g. ("-mno-avx2",)); SANITIZE_FLAGS follow them
    under $FP8RL_KERNEL_SANITIZE."""
    cc = os.environ.get("CC", "cc")
    extra_flags = tuple(extra_flags) + (SANITIZE_FLAGS if sanitizing() else ())
    folder = Path(cache_dir or os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "fp8rl" / "kernels")
    lib = library_path(source, folder, extra_flags, cc)
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        try:
            _compile(cc, source, Path(tmp), openmp=True, extra=extra_flags)
        except subprocess.CalledProcessError:  # a compiler without OpenMP: single-threaded kernels
            _compile(cc, source, Path(tmp), openmp=False, extra=extra_flags)
        os.replace(tmp, lib)  # atomic: a concurrent loader sees no file or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
