"""The C kernels as C: their shared header, a -Wall -Wextra -Werror build for every SIMD target the sources
select (compiling for a target needs no CPU that runs it, so the AMX build is checked on an AVX2 machine),
and the bit-exactness cases rerun on AddressSanitizer + UBSan builds (only the paths this CPU runs)."""
from __future__ import annotations

import ctypes
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl_core.fp8 import cbuild, cpu_gemm, fused_cpu

ROOT = Path(__file__).resolve().parents[3]
CC = os.environ.get("CC", "cc")
x86 = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 SIMD targets")
needs_cc = pytest.mark.skipif(shutil.which(CC) is None, reason=f"needs a C compiler ({CC})")
# the existing bit-exactness cases: every fused path this CPU runs against the reference, the GEMM's portable
# path against float64 and its SIMD paths against the portable one (the rest of those modules adds no kernel call)
SANITIZED_CASES = ("tests/fp8rl_core/fp8/test_fused_cpu_simd.py", "tests/fp8rl_core/fp8/test_cpu_gemm.py",
                   "-k", "bit_for_bit or rounding or declined or large_tensor or portable_path or strided "
                   "or equals_portable or amx_within")


def test_every_header_define_reaches_python():
    """Each `#define FP8RL_*` of the header (but its include guard) is an integer the wrappers can read."""
    text = cbuild.HEADER.read_text()
    named = set(re.findall(r"^#define\s+(FP8RL_\w+)", text, re.MULTILINE)) - {"FP8RL_KERNELS_H"}
    assert named and named == set(cbuild.constants())
    assert fused_cpu.SIMD_PATHS[cbuild.constants()["FP8RL_SIMD_AVX2"]] == "avx2"
    assert (cpu_gemm.BK, cpu_gemm.PATHS["amx"]) == (128, cbuild.constants()["FP8RL_GEMM_PATH_AMX"])


_CTYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "fp8rl_scales": cpu_gemm._Scales}


def _prototypes() -> dict[str, list]:
    """The header's function prototypes as ctypes argument types (any pointer: c_void_p)."""
    out = {}
    for name, params in re.findall(r"^(?:int|void) (fp8rl_\w+)\(([^)]*)\);", cbuild.HEADER.read_text(), re.MULTILINE):
        types = [" ".join(p.split()[:-1]) if "*" not in p else "*" for p in params.split(",") if p.strip() != "void"]
        out[name] = [ctypes.c_void_p if t == "*" else _CTYPES[t.replace("const ", "")] for t in types]
    return out


@needs_cc
def test_wrappers_declare_the_headers_signatures():
    """Every prototype of the header is declared with the same argument types by the wrapper that loads it."""
    protos = _prototypes()
    assert {"fp8rl_quantize", "fp8rl_dequantize", "fp8rl_gemm", "fp8rl_gemm_codes", "fp8rl_pack_b"} <= set(protos)
    libs = [fused_cpu.load(fused_cpu.build()), cpu_gemm.load(cbuild.build(cpu_gemm.SOURCE))]
    for name, argtypes in protos.items():
        lib = next(lib for lib in libs if hasattr(lib, name))
        declared = getattr(lib, name).argtypes
        assert list(declared or []) == argtypes, name


@needs_cc
def test_cache_key_follows_the_header(tmp_path):
    """A changed header names another library (a rebuild); the same files name the same one."""
    for name in ("fused_cpu.c", "fp8rl_kernels.h"):
        shutil.copy(fused_cpu.SOURCE.with_name(name), tmp_path / name)
    source, cache = tmp_path / "fused_cpu.c", tmp_path / "cache"
    before = cbuild.library_path(source, cache, (), CC)
    assert cbuild.library_path(source, cache, (), CC) == before
    (tmp_path / "fp8rl_kernels.h").write_text(cbuild.HEADER.read_text().replace("FP8RL_OK 0", "FP8RL_OK 0 "))
    assert cbuild.library_path(source, cache, (), CC) != before


def _targets():
    """(source, target name, gcc flags, the -D that the source checks against what the flags selected)."""
    h = cbuild.constants()
    simd = {"avx512": "FP8RL_SIMD_AVX512", "avx2": "FP8RL_SIMD_AVX2", "scalar": "FP8RL_SIMD_SCALAR"}
    for name, flags in fused_cpu.TARGETS.items():
        yield fused_cpu.SOURCE, name, flags, f"-DFP8RL_EXPECT_SIMD={h[simd[name]]}"
    for name, (flags, paths) in cpu_gemm.TARGETS.items():
        bits = sum(h[f"FP8RL_GEMM_HAS_{p.upper()}"] for p in paths)
        yield cpu_gemm.SOURCE, name, flags, f"-DFP8RL_EXPECT_PATHS={bits}"


def _skip_unknown_flags(flags) -> None:
    for flag in flags:
        probe = subprocess.run([CC, "-Werror", flag, "-E", "-x", "c", os.devnull], capture_output=True)
        if probe.returncode:
            pytest.skip(f"needs a compiler that knows {flag} ({CC})")


@x86
@needs_cc
@pytest.mark.parametrize("source,target,flags,expect", list(_targets()), ids=lambda v: getattr(v, "name", None))
def test_warning_free_build_of_every_target(source, target, flags, expect, tmp_path):
    _skip_unknown_flags(flags)
    try:
        cbuild.check_warnings(source, tmp_path, ("-march=x86-64", *flags), (expect,))
    except subprocess.CalledProcessError as err:
        pytest.fail(f"{source.name} for {target} ({' '.join(flags) or 'baseline x86-64'}):\n{err.stderr}")
    assert (tmp_path / f"{source.stem}.so").stat().st_size > 0


@x86
@needs_cc
def test_a_target_that_selects_another_path_fails_the_build(tmp_path):
    """The -DFP8RL_EXPECT_* check can fail: AVX2 flags do not give the AVX-512 path."""
    expect = f"-DFP8RL_EXPECT_SIMD={cbuild.constants()['FP8RL_SIMD_AVX512']}"
    with pytest.raises(subprocess.CalledProcessError, match="returned non-zero"):
        cbuild.check_warnings(fused_cpu.SOURCE, tmp_path, ("-march=x86-64", *fused_cpu.TARGETS["avx2"]), (expect,))


def _sanitizer_env(cache: Path) -> dict[str, str]:
    preload = cbuild.sanitizer_preload(CC)
    if not all(os.path.isabs(lib) and os.path.exists(lib) for lib in preload.split()):
        pytest.skip(f"needs the compiler's ASan and UBSan runtimes ({CC} -print-file-name: {preload})")
    return {**os.environ, cbuild.ENV_SANITIZE: "1", cbuild.ENV_CACHE: str(cache), "LD_PRELOAD": preload,
            "ASAN_OPTIONS": "detect_leaks=0", "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
@needs_cc
def test_bit_exactness_cases_run_clean_under_asan_and_ubsan(tmp_path):
    """The sanitized builds (a fresh cache: every library loaded is one) pass the cases with no report."""
    env = _sanitizer_env(tmp_path / "cache")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "t"),
           *SANITIZED_CASES]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    for report in ("ERROR: AddressSanitizer", "runtime error:", "ERROR: LeakSanitizer"):
        assert report not in out, out[-6000:]
    assert run.returncode == 0 and int(re.search(r"(\d+) passed", out).group(1)) > 0, out[-6000:]
    libs = sorted((tmp_path / "cache").glob("*.so"))
    assert {lib.name.split("-")[0] for lib in libs} == {"fused_cpu", "cpu_gemm"}
    for lib in libs:
        data = lib.read_bytes()
        assert b"__asan_init" in data and b"__ubsan_handle" in data, f"{lib.name} is not sanitized"
