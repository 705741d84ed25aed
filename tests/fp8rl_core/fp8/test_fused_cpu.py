"""The fused CPU quantizer (fused_cpu.c, this machine's default build) against the pure-torch reference
kernels, bit for bit; test_fused_cpu_simd.py checks each vector path (AVX-512, AVX2, portable C)."""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.fp8 import dequantize_blockwise, fused_cpu, kernels, quantize_blockwise
from fp8rl_core.fp8.quant import from_blocks, to_blocks

BLOCKS = [(1, 128), (128, 128), (128, 1), (3, 7)]


def reference(x2: torch.Tensor, block, power_of_two: bool):
    """kernels.quantize_blocks (the eager reference) on a 2-D tensor, unblocked."""
    qb, scale, deqb = kernels.quantize_blocks(to_blocks(x2, block), power_of_two, True)
    m, n = x2.shape
    return from_blocks(qb, m, n), scale, from_blocks(deqb, m, n)


def wide_range(shape, dtype, seed=0) -> torch.Tensor:
    """Rows scaled over 1e-40 .. 1e30 (E4M3 subnormals, FP32 subnormal scales), plus zero blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-40, 30, (shape[0], 1), generator=g).float()
    x[0, : min(3, shape[1])] = 0.0
    if shape[0] > 2:
        x[2] = 0.0  # an all-zero row: scale 1
    return x.to(dtype)


def bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def test_library_builds_here():
    assert fused_cpu.library() is not None, "the C compiler (cc) must work on this machine"
    assert fused_cpu.simd_path() in ("avx512", "avx2", "scalar")  # each path: test_fused_cpu_simd.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("shape", [(300, 1000), (257, 129), (1, 5)])
def test_quantize_matches_reference_bit_for_bit(dtype, block, power_of_two, shape):
    x = wide_range(shape, dtype)
    q0, s0, d0 = reference(x, block, power_of_two)
    q1, s1, d1 = fused_cpu.quantize(x, block, power_of_two, want_dequant=True)
    assert torch.equal(bits(q1), bits(q0))
    assert torch.equal(s1, s0)
    assert torch.equal(d1.view(torch.int32), d0.contiguous().view(torch.int32))  # -0.0 included
    q2, s2, d2 = fused_cpu.quantize(x, block, power_of_two, want_dequant=False)
    assert d2 is None and torch.equal(bits(q2), bits(q0)) and torch.equal(s2, s0)
    q3, s3, d3 = fused_cpu.quantize(x, block, power_of_two, want_dequant=True, want_q=False)  # the emulated GEMM's
    assert q3 is None and torch.equal(s3, s0) and torch.equal(d3.view(torch.int32), d0.contiguous().view(torch.int32))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
def test_dequantize_matches_reference_bit_for_bit(out_dtype, block):
    x = wide_range((257, 300), torch.bfloat16, seed=1)
    q, s, _ = reference(x, block, False)
    ref = from_blocks(kernels.dequantize_blocks(to_blocks(q, block), s, out_dtype), *q.shape)
    got = fused_cpu.dequantize(q, s, block, out_dtype)
    assert got is not None and got.dtype == out_dtype
    assert torch.equal(got, ref) and torch.equal(got.signbit(), ref.signbit())


def test_e4m3_rounding_of_every_bf16_value():
    """Every finite BF16 value in [-448, 448] (scale 1) rounds as torch's own float8 cast does."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    v = every[torch.isfinite(every)].clamp(-448, 448)
    x = torch.cat([torch.tensor([448.0]), v]).reshape(1, -1)  # one block with amax 448: scale exactly 1
    q, s, d = fused_cpu.quantize(x, (1, x.shape[1]), False, want_dequant=True)
    assert s.item() == 1.0
    want = v.to(torch.float8_e4m3fn)
    assert torch.equal(bits(q)[0, 1:], bits(want))
    assert torch.equal(d[0, 1:], want.float())


def test_e4m3_rounding_of_random_fp32_bit_patterns():
    g = torch.Generator().manual_seed(2)
    u = torch.randint(0, 2**32, (1_000_000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    v = u[torch.isfinite(u)].clamp(-448, 448)
    x = torch.cat([torch.tensor([448.0]), v]).reshape(1, -1)
    q, _, _ = fused_cpu.quantize(x, (1, x.shape[1]), False, want_dequant=False)
    assert torch.equal(bits(q)[0, 1:], bits(v.to(torch.float8_e4m3fn)))


def test_non_finite_blocks_fall_back_to_the_reference():
    x = torch.randn(4, 256)
    x[1, 3], x[2, 200] = float("nan"), float("inf")
    assert fused_cpu.quantize(x, (1, 128), False, want_dequant=True) is None
    with pytest.raises(ValueError, match="non-finite"):
        quantize_blockwise(x, (1, 128))
    q, s = quantize_blockwise(x, (1, 128), check_finite=False)
    q0, s0, _ = reference(x, (1, 128), False)
    assert torch.equal(bits(q), bits(q0)) and torch.equal(s.isnan(), s0.isnan())
    assert fused_cpu.dequantize(q, torch.ones(4, 2), (1, 128), torch.float32) is None  # a NaN code


def test_public_functions_use_it_and_agree_with_it_off(monkeypatch):
    x = wide_range((200, 384), torch.bfloat16, seed=3)
    fused = [quantize_blockwise(x, b) for b in BLOCKS]
    deq = [dequantize_blockwise(q, s, b, out_dtype=torch.bfloat16) for (q, s), b in zip(fused, BLOCKS)]
    monkeypatch.setenv(fused_cpu.ENV_OFF, "0")
    assert fused_cpu.quantize(x, (1, 128), False, False) is None
    for b, (q1, s1), d1 in zip(BLOCKS, fused, deq):
        q0, s0 = quantize_blockwise(x, b)
        assert torch.equal(bits(q1), bits(q0)) and torch.equal(s1, s0)
        assert torch.equal(d1, dequantize_blockwise(q0, s0, b, out_dtype=torch.bfloat16))


def test_non_contiguous_input_and_threads():
    x = wide_range((384, 256), torch.float32, seed=4).t()  # a transposed view
    q0, s0, d0 = reference(x, (1, 128), False)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            q1, s1, d1 = fused_cpu.quantize(x, (1, 128), False, True)
            assert torch.equal(bits(q1), bits(q0)) and torch.equal(s1, s0) and torch.equal(d1, d0)
    finally:
        torch.set_num_threads(old)


def test_build_is_cached_on_disk(tmp_path):
    lib = fused_cpu.build(tmp_path)
    stamp = lib.stat().st_mtime_ns
    assert fused_cpu.build(tmp_path) == lib and lib.stat().st_mtime_ns == stamp  # found, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [lib.name]  # no temporary file left behind
