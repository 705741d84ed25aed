"""The cpu_bf16dot executor (cpu_gemm.c) against float64, its portable C path, and its SIMD paths.

Which bound applies: the kernel computes DeepSeek's order (per K-block an FP32 sum of exact E4M3
products, then (P * sa) * sb added to an FP32 accumulator), so it is held to emulated_blockwise's bound
    |C - C_ref| <= (bk + Kb + 2) * 2**-24 * C_abs                     (test_gemm.py's `tolerance`)
and not to the default "emulated" executor's (K + 4) u bound, which covers a dequantize-first GEMM.
- portable C ("c"): runs on every CPU with a C compiler; checked against float64 with that bound.
- AVX512_BF16: VDPBF16PS adds a pair's odd product, then its even one, each rounded to FP32 (Intel SDM);
  the portable path keeps that order, so the two agree bit for bit.
- AMX: TDPBF16PS's internal accumulation is not bit-specified (measured here: it matches no sequential
  FP32 order, nor exact pair or 32-term sums rounded once), so it is held to the bound against float64.
Paths the CPU lacks skip, naming the missing flag.
"""
from __future__ import annotations

import pytest
import torch
from test_gemm import make_operands, reference_mm, tolerance

from fp8rl_core.fp8 import cbuild, cpu_features, cpu_gemm, gemm, select_executor
from fp8rl_core.fp8.linear import Fp8Linear
from fp8rl_core.fp8.operand import Operand

LIB = cpu_gemm.library()
needs_lib = pytest.mark.skipif(LIB is None, reason="no working C compiler (cc) to build cpu_gemm.c")
SHAPES = [(1, 1, 1), (5, 7, 128), (130, 129, 300), (64, 256, 1024), (33, 65, 129)]


def needs(path: str):
    flags = {"avx512_bf16": ("avx512_bf16",), "amx": ("amx_tile", "amx_bf16")}[path]
    lacking = cpu_features.missing(*flags)
    return pytest.mark.skipif(bool(lacking) or LIB is None, reason=f"needs CPU flag(s) {' '.join(lacking)}")


def run(path, m, n, k, block_b, seed=0, transposed=False):
    qa, sa, qb, sb = make_operands(m, n, k, block_b, seed=seed)
    a, b = Operand(qa, sa, (1, 128)), Operand(qb, sb, block_b)
    if transposed:  # the same values, read through transposed views (the wgrad operands' layout)
        a = Operand(qa.t().contiguous().t(), sa, (1, 128))
        b = Operand(qb.t().contiguous().t(), sb, block_b)
    return cpu_gemm.mm(a, b, path_name=path), (qa, sa, qb, sb)


def check_bound(c, ops, block_b, k):
    c_ref, c_abs = reference_mm(*ops, (1, 128), block_b)
    err, tol = (c.double() - c_ref).abs(), tolerance(c_abs, k, "emulated_blockwise")
    assert torch.all(err <= tol), f"max err/tol {(err / tol).max().item()}"


@needs_lib
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("block_b", [(128, 128), (1, 128)])
def test_portable_path_matches_float64(m, n, k, block_b):
    c, ops = run("c", m, n, k, block_b, seed=m + n + k)
    assert c.shape == (m, n) and c.dtype == torch.float32
    check_bound(c, ops, block_b, k)


@needs_lib
def test_portable_path_bound_is_tight():
    """One E4M3 step in one operand element moves the result outside the bound."""
    qa, sa, qb, sb = make_operands(16, 16, 256, (128, 128))
    c = cpu_gemm.mm(Operand(qa, sa, (1, 128)), Operand(qb, sb, (128, 128)), path_name="c")
    qa2 = qa.clone()
    qa2[3, 5] = (qa[3, 5].float() * (1 + 2.0**-3)).clamp(-448, 448).to(torch.float8_e4m3fn)
    c_ref, c_abs = reference_mm(qa2, sa, qb, sb, (1, 128), (128, 128))
    assert not torch.all((c.double() - c_ref).abs() <= tolerance(c_abs, 256, "emulated_blockwise"))


@needs_lib
def test_strided_operands_and_epilogue():
    """Transposed views pack to the same bits; bias + BF16 output = the FP32 result + bias, then cast."""
    for m, k in ((70, 384), (64, 300), (48, 37)):  # packers: generic, and 16-row blocks with a K tail
        c, ops = run("c", m, 90, k, (1, 128))
        ct, _ = run("c", m, 90, k, (1, 128), transposed=True)
        assert torch.equal(c, ct), (m, k)
    c, ops = run("c", 70, 90, 384, (1, 128))
    qa, sa, qb, sb = ops
    packed = cpu_gemm.pack_a(Operand(qa, sa, (1, 128)))  # A packed ahead (PackedA) or inside the call: same bits
    assert torch.equal(cpu_gemm.mm(packed, Operand(qb, sb, (1, 128)), path_name="c"), c)
    bias = torch.randn(90)
    out = cpu_gemm.mm(Operand(qa, sa, (1, 128)), Operand(qb, sb, (1, 128)), torch.bfloat16, bias=bias, path_name="c")
    assert out.dtype == torch.bfloat16 and torch.equal(out, (c + bias).to(torch.bfloat16))


@needs("avx512_bf16")
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("block_b", [(128, 128), (1, 128)])
def test_avx512_bf16_equals_portable_path(m, n, k, block_b):
    want, _ = run("c", m, n, k, block_b, seed=m + n + k)
    got, _ = run("avx512_bf16", m, n, k, block_b, seed=m + n + k)
    assert torch.equal(got, want)


@needs("amx")
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("block_b", [(128, 128), (1, 128)])
def test_amx_within_bound(m, n, k, block_b):
    c, ops = run("amx", m, n, k, block_b, seed=m + n + k)
    check_bound(c, ops, block_b, k)


@needs_lib
def test_executor_follows_cpu_flags(monkeypatch):
    monkeypatch.delenv("FP8RL_GEMM", raising=False)
    want = "cpu_bf16dot" if cpu_gemm.path() == "amx" else "emulated"
    assert select_executor("cpu") == want
    monkeypatch.setenv(cpu_features.ENV_OFF, "amx_bf16")  # AVX512_BF16 alone: the executor on request only
    assert cpu_gemm.path() in (None, "avx512_bf16") and select_executor("cpu") == "emulated"
    monkeypatch.setenv(cpu_features.ENV_OFF, "amx_bf16 avx512_bf16")
    assert cpu_gemm.path() is None and select_executor("cpu") == "emulated"
    qa, sa, qb, sb = make_operands(4, 4, 128, (128, 128))
    with pytest.raises(RuntimeError, match="no BF16 dot-product path here"):
        cpu_gemm.mm(Operand(qa, sa, (1, 128)), Operand(qb, sb, (128, 128)))


@pytest.mark.skipif(cpu_gemm.path() is None,
                    reason=f"needs CPU flag avx512_bf16 or amx_bf16 (has: {cpu_features.kernel_flags()})")
def test_fp8_linear_on_bf16dot_matches_blockwise_emulation(monkeypatch):
    """Fp8Linear forward, dgrad and wgrad on cpu_bf16dot agree with emulated_blockwise (DeepSeek's order
    in torch) within twice the blockwise bound's relative size, measured on the outputs."""
    def grads(executor):
        monkeypatch.setenv("FP8RL_GEMM", executor)
        torch.manual_seed(0)
        lin = Fp8Linear(256, 384, bias=True)
        x = (torch.randn(300, 256) * 3).requires_grad_()
        y = lin(x)
        y.backward(torch.randn_like(y))
        return y.detach(), x.grad, lin.weight.grad, lin.bias.grad

    ref, got = grads("emulated_blockwise"), grads("cpu_bf16dot")
    assert gemm.select_executor("cpu") == "cpu_bf16dot"
    for name, r, g in zip(("y", "dx", "dw", "db"), ref, got):
        rel = ((g - r).abs().max() / r.abs().max()).item()
        assert rel <= 2 * (128 + 8 + 2) * 2.0**-24, (name, rel)


@needs_lib
@pytest.mark.parametrize("flags,paths", [
    (("-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16"), 1),  # AVX-512 without BF16 dot products
    (("-mno-avx512f",), 1),  # no AVX-512 at all: the portable loops only
])
def test_builds_without_the_instructions_keep_the_portable_bits(flags, paths, tmp_path):
    """The file builds for CPUs without the instructions (the SIMD paths compiled out, what a build on
    such a CPU gets from -march=native), and its portable path gives this build's bits."""
    lib = cpu_gemm.load(cbuild.build(cpu_gemm.SOURCE, cache_dir=tmp_path, extra_flags=flags))
    assert lib.fp8rl_gemm_paths() == paths
    for m, k, transposed in ((64, 300, True), (70, 384, False)):
        qa, sa, qb, sb = make_operands(m, 90, k, (1, 128), seed=k)
        a = Operand(qa.t().contiguous().t() if transposed else qa, sa, (1, 128))
        b = Operand(qb, sb, (1, 128))
        want = cpu_gemm.mm(a, b, path_name="c")
        assert torch.equal(cpu_gemm.mm(a, b, path_name="c", lib=lib), want)
    with pytest.raises(RuntimeError, match="not compiled"):
        cpu_gemm.mm(a, b, path_name="avx512_bf16", lib=lib)


@needs_lib
def test_compiled_fp8_linear_equals_eager():
    """Under torch.compile the C kernels (fused quantizer, this GEMM) run eagerly (torch.compiler.disable):
    traced by Dynamo, the ctypes calls wrote through fake tensors' pointers (a heap corruption abort)."""
    torch.manual_seed(0)
    lin = Fp8Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    y0 = lin(x)
    y0.sum().backward()
    g0, x.grad = x.grad, None
    y1 = torch.compile(lin, backend="aot_eager")(x)
    y1.sum().backward()
    assert torch.equal(y0, y1) and torch.equal(g0, x.grad)


def test_print_config_names_the_fp8_gemm_and_its_flags(capsys):
    """`fp8rl-train --print-config` (quickstart prints it) says which executor the FP8 GEMMs take here and how it
    is chosen (fp8/choice.py note: nothing measured; the tests run with the calibration off)."""
    from fp8rl_core.cli import main
    from fp8rl_core.fp8.choice import note

    assert main(["--print-config"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("# FP8 GEMM: "))
    assert line == f"# FP8 GEMM: {note('auto', 'cpu')} (on cpu; CPU flags: {cpu_features.kernel_flags()})"
    assert line.startswith(f"# FP8 GEMM: {select_executor('cpu')} (the default: $FP8RL_GEMM_CALIBRATE=0)")


@needs_lib
def test_a_weight_is_packed_once_per_quantization_and_orientation():
    """W (fprop) and W^T (dgrad) are packed once and kept in the weight's kernel cache; an operand without a
    cache (an activation) is packed afresh."""
    w = Fp8Linear(256, 384).quantized_weight()
    fprop, dgrad = cpu_gemm.pack_b(w.operand()), cpu_gemm.pack_b(w.operand().t())
    assert cpu_gemm.pack_b(w.operand()) is fprop and cpu_gemm.pack_b(w.operand().t()) is dgrad
    assert fprop is not dgrad and len(w.kernel_cache) == 2
    bare = Operand(w.q, w.scale, (128, 128))
    assert cpu_gemm.pack_b(bare) is not cpu_gemm.pack_b(bare)
    assert torch.equal(cpu_gemm.pack_b(bare).data, fprop.data)
