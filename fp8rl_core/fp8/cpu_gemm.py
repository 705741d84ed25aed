"""The "cpu_bf16dot" executor: the blockwise-FP8 GEMM on the CPU's BF16 dot-product instructions.

    C[M, N] = sum_kb (P_kb * sa_kb[:, None]) * sb_kb[None, :],   P_kb = QA_kb @ QB_kb^T   (cpu_gemm.c)

E4M3 values are exact in BF16 and their products exact in FP32, so AMX TDPBF16PS and AVX512_BF16
VDPBF16PS compute P_kb with exact products and FP32 accumulation: DeepSeek-V3's fp8_gemm contract, at
BF16 speed instead of an FP32 GEMM's. Error against float64 (tests): within emulated_blockwise's bound,
    |C - C_exact| <= (bk + Kb + 2) * 2**-24 * C_abs,   C_abs = sum_kb |sa||sb| (|QA_kb| @ |QB_kb|^T),
because it is the same computation in the same order (per block: k ascending, then scale, then add).
The portable C path ("c") keeps that order literally; the SIMD paths are checked against it bit for bit.

Paths, picked by this CPU's flags (cpu_features.py; FP8RL_CPU_FLAGS_OFF hides flags):
  "amx"          amx_tile + amx_bf16 (the OS must grant tile state: fp8rl_amx_init)
  "avx512_bf16"  avx512_bf16
  "c"            portable C (tests; it is slower than the FP32 emulation, so no run selects it)
`path()` says which one this CPU runs (None: neither instruction). Whether a run takes it is measured,
not assumed (calibrate.py): the executor's speed against the FP32 emulation depends on the CPU's BF16
dot-product rate against its FP32 FMA rate (on Intel, VDPBF16PS has the MAC rate of two FP32 FMAs: 0.6x the
emulation on Sapphire Rapids with AMX hidden; on an AMD EPYC with AVX512_BF16, 1.42-1.49x faster; timings in
docs/design.md section 9). The static default (`preferred()`: the path is "amx") is what the calibration
must beat by its margin; any CPU with a path is a candidate. FP8RL_GEMM=cpu_bf16dot fixes it outright.
Weights are packed once per quantization (`PackedB`, kept in the weight operand's `cache`: Fp8Weight.kernel_cache).
"""
from __future__ import annotations

import ctypes
import functools
import os
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from fp8rl_core.fp8 import cbuild, cpu_features
from fp8rl_core.fp8.operand import Operand

SOURCE = Path(__file__).with_name("cpu_gemm.c")
_H = cbuild.constants()  # fp8rl_kernels.h: the path codes, compiled-path bits, blocking and return codes
PATHS = {"c": _H["FP8RL_GEMM_PATH_C"], "avx512_bf16": _H["FP8RL_GEMM_PATH_AVX512_BF16"],
         "amx": _H["FP8RL_GEMM_PATH_AMX"]}
_COMPILED_BIT = {"c": _H["FP8RL_GEMM_HAS_C"], "avx512_bf16": _H["FP8RL_GEMM_HAS_AVX512_BF16"],
                 "amx": _H["FP8RL_GEMM_HAS_AMX"]}
BK, MR, NR = _H["FP8RL_GEMM_BK"], _H["FP8RL_GEMM_MR"], _H["FP8RL_GEMM_NR"]
# each variant the source selects, as a target (on -march=x86-64) with the paths it compiles (fp8rl_gemm_paths):
# the -Werror builds compile every one on any x86 CPU ("avx512bw": the vector packers without a dot product)
_AVX512 = ("-mavx512f", "-mavx512bw")
TARGETS = {"c": ((), ("c",)), "avx512bw": (_AVX512, ("c",)),
           "avx512_bf16": ((*_AVX512, "-mavx512bf16"), ("c", "avx512_bf16")),
           "amx": ((*_AVX512, "-mavx512bf16", "-mamx-tile", "-mamx-bf16"), ("c", "avx512_bf16", "amx"))}
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built kernels, or None (one warning) where no C compiler works."""
    try:
        return load(cbuild.build(SOURCE))
    except (OSError, subprocess.SubprocessError) as err:
        warnings.warn(f"fp8rl: CPU BF16-dot GEMM unavailable ({err})", stacklevel=2)
        return None


def load(lib_path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(lib_path))
    lib.fp8rl_gemm_paths.restype = _int
    lib.fp8rl_amx_init.restype = _int
    for name in ("fp8rl_pack_a", "fp8rl_pack_b"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _int]
    lib.fp8rl_gemm_codes.restype = _int
    lib.fp8rl_gemm_codes.argtypes = [_ptr, _i64, _i64, _ptr, _Scales, _Scales, _i64, _i64, _i64, _i64, _i64, _i64,
                                     _ptr, _ptr, _i64, _int, _int, _int]
    lib.fp8rl_gemm.restype = _int
    lib.fp8rl_gemm.argtypes = [_ptr, _ptr, _Scales, _Scales, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _int, _int,
                               _int]
    return lib


@functools.cache
def _amx_granted(lib: ctypes.CDLL) -> bool:
    return lib.fp8rl_amx_init() == 0


def path(lib: ctypes.CDLL | None = None) -> str | None:
    """The fastest path this CPU runs: "amx", "avx512_bf16", or None (neither instruction, no compiler,
    or a library built without them). Asked at every GEMM: cached per value of $FP8RL_CPU_FLAGS_OFF."""
    return _path(os.environ.get(cpu_features.ENV_OFF, ""), lib)


@functools.cache
def _path(hidden: str, lib: ctypes.CDLL | None) -> str | None:
    if not (cpu_features.has("avx512_bf16") or cpu_features.has("amx_tile", "amx_bf16")):
        return None  # decided by the flags alone: no build on CPUs without the instructions
    lib = lib or library()
    if lib is None:
        return None
    compiled = lib.fp8rl_gemm_paths()
    if cpu_features.has("amx_tile", "amx_bf16") and compiled & _COMPILED_BIT["amx"] and _amx_granted(lib):
        return "amx"
    if cpu_features.has("avx512_bf16") and compiled & _COMPILED_BIT["avx512_bf16"]:
        return "avx512_bf16"
    return None


def preferred() -> bool:
    """Whether the static rule (gemm.default_executor, the calibration's default) picks cpu_bf16dot: on AMX
    only; elsewhere the calibration takes it only where it measures >= 1.15x the emulation (module docstring)."""
    return path() == "amx"


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _codes(op: Operand) -> torch.Tensor:
    if op.q is None:
        raise ValueError("cpu_bf16dot: the operand has no E4M3 codes (quantized for the emulated executor)")
    return op.q.view(torch.uint8)


class _Scales(ctypes.Structure):
    """An operand's block scales read in place by the kernel: row r, K-block kb at s[(r // block) * r_stride +
    kb * k_stride] (fp8rl_kernels.h `fp8rl_scales`)."""

    _fields_ = [("s", _ptr), ("r", _i64), ("k", _i64), ("block", _i64)]


def _scales(scale: torch.Tensor, block_rows: int) -> tuple[torch.Tensor, _Scales]:
    """(the FP32 scale tensor to keep alive, its descriptor)."""
    s = scale if scale.dtype == torch.float32 else scale.float()
    return s, _Scales(s.data_ptr(), s.stride(0), s.stride(1), block_rows)


@dataclass(frozen=True)
class PackedA:
    """A [M, K] as BF16 in AMX A-tile order (data [Mp, Kp] holds tiles [Mp/16][Kp/32][16][32], cpu_gemm.c)
    with its FP32 block scales [ceil(M/br), Kb], read in place."""

    data: torch.Tensor
    scale: torch.Tensor
    block_rows: int
    rows: int


@dataclass(frozen=True)
class PackedB:
    """B [N, K] as BF16 VNNI [Np/16, Kp/2, 16, 2] with its FP32 block scales [ceil(N/br), Kb], read in place."""

    data: torch.Tensor
    scale: torch.Tensor
    block_rows: int
    rows: int


def _check_k(op: Operand) -> None:
    if op.block[1] != BK:
        raise ValueError(f"cpu_bf16dot: K-block {op.block[1]} (only {BK} is compiled)")


def _layout(op: Operand, row_multiple: int) -> tuple[torch.Tensor, int, int, int, int]:
    """(the operand's codes [R, K] as uint8, R, K, R and K padded) for a packer (cpu_gemm.c's layouts)."""
    _check_k(op)
    codes = _codes(op)
    rows, k = codes.shape
    return codes, rows, k, _round_up(max(rows, 1), row_multiple), _round_up(max(k, 1), BK)


@torch.compiler.disable  # ctypes reads data pointers: opaque to Dynamo, always eager
def pack_a(op: Operand, lib: ctypes.CDLL | None = None) -> PackedA:
    codes, m, k, mp, kp = _layout(op, MR)
    out = torch.empty(mp, kp, dtype=torch.bfloat16)
    (lib or library()).fp8rl_pack_a(codes.data_ptr(), *codes.stride(), m, k, mp, kp, out.data_ptr(),
                                    torch.get_num_threads())
    return PackedA(out, op.scale, op.block[0], m)


@torch.compiler.disable  # ctypes reads data pointers: opaque to Dynamo, always eager
def pack_b(op: Operand, lib: ctypes.CDLL | None = None) -> PackedB:
    """B packed, or the pack kept in op.cache (a weight's: W and W^T, keyed by shape and strides)."""
    key = ("cpu_bf16dot.b", tuple(op.q.shape) if op.q is not None else None,
           op.q.stride() if op.q is not None else None)
    if op.cache is not None and key in op.cache:
        return op.cache[key]
    codes, n, k, np_, kp = _layout(op, NR)
    out = torch.empty(np_ // 16, kp // 2, 16, 2, dtype=torch.bfloat16)
    (lib or library()).fp8rl_pack_b(codes.data_ptr(), *codes.stride(), n, k, np_, kp, out.data_ptr(),
                                    torch.get_num_threads())
    packed = PackedB(out, op.scale, op.block[0], n)
    if op.cache is not None:
        op.cache[key] = packed
    return packed


@torch.compiler.disable  # ctypes reads data pointers: opaque to Dynamo, always eager
def mm(a: Operand | PackedA, b: Operand | PackedB, out_dtype: torch.dtype = torch.float32,
       bias: torch.Tensor | None = None, path_name: str | None = None, lib: ctypes.CDLL | None = None
       ) -> torch.Tensor:
    """C [M, N] = A . B^T (+ bias [N] in FP32) in out_dtype (FP32 or BF16; others are cast from FP32).

    a, b: Operands or already packed ones (an Operand A is packed inside the GEMM's call: one call, no
    tensor); path_name: "amx" | "avx512_bf16" | "c" (default: this CPU's fastest, `path()`)."""
    lib = lib or library()
    name = path_name or path(lib)
    if lib is None or name is None:
        raise RuntimeError(f"cpu_bf16dot: no BF16 dot-product path here (CPU flags: {cpu_features.kernel_flags()})")
    if name == "amx" and not _amx_granted(lib):  # a tile instruction without the OS's grant is SIGILL
        raise RuntimeError("cpu_bf16dot: the OS did not grant AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    pb = b if isinstance(b, PackedB) else pack_b(b, lib)
    np_, kp = pb.data.shape[0] * 16, pb.data.shape[1] * 2
    if isinstance(a, PackedA):
        (mp, kpa), rows, a_scale, a_block = a.data.shape, a.rows, a.scale, a.block_rows
    else:
        codes, rows, k, mp, kpa = _layout(a, MR)
        a_scale, a_block = a.scale, a.block[0]
    if kpa != kp:
        raise ValueError(f"cpu_bf16dot: padded K differs (A {kpa}, B {kp})")
    direct = out_dtype in (torch.float32, torch.bfloat16)
    c = torch.empty(rows, pb.rows, dtype=out_dtype if direct else torch.float32)
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
    (sa_t, sa), (sb_t, sb) = _scales(a_scale, a_block), _scales(pb.scale, pb.block_rows)
    tail = (None if bias is None else bias.data_ptr(), c.data_ptr(), pb.rows, int(c.dtype == torch.bfloat16),
            PATHS[name], torch.get_num_threads())
    if isinstance(a, PackedA):
        bad = lib.fp8rl_gemm(a.data.data_ptr(), pb.data.data_ptr(), sa, sb, rows, pb.rows, mp, np_, kp, *tail)
    else:
        bad = lib.fp8rl_gemm_codes(codes.data_ptr(), *codes.stride(), pb.data.data_ptr(), sa, sb, rows, pb.rows,
                                   k, mp, np_, kp, *tail)
    del sa_t, sb_t  # the scale tensors the descriptors point into lived until here
    if bad == _H["FP8RL_GEMM_BAD_BLOCK"]:
        raise ValueError(f"cpu_bf16dot: row blocks {a_block}, {pb.block_rows}: powers of two only")
    if bad == _H["FP8RL_GEMM_NO_MEMORY"]:
        raise MemoryError(f"cpu_bf16dot: no memory for A's packed copy ({mp} x {kp} BF16)")
    if bad != _H["FP8RL_OK"]:  # FP8RL_GEMM_NOT_COMPILED
        raise RuntimeError(f"cpu_bf16dot: path {name!r} is not compiled into {SOURCE.name}")
    return c if direct else c.to(out_dtype)
