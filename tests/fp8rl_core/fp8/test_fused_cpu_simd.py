"""Each vector path of the fused CPU quantizer (AVX-512, AVX2, portable C) against the pure-torch reference,
bit for bit: every path is built here with the flags that select it (a path this CPU cannot run skips,
naming the flag it lacks). Shapes with row tails and widths around the 16/32/64-lane steps, subnormal
inputs and results, exact ties, zeros, -0, BF16 input, power-of-two scales, non-finite blocks declined."""
from __future__ import annotations

import platform

import pytest
import torch

from fp8rl_core.fp8 import cpu_features, fused_cpu, kernels
from fp8rl_core.fp8.quant import from_blocks, to_blocks

PATHS = ("avx512", "avx2", "scalar")
BLOCKS = [(1, 128), (128, 128), (128, 1), (3, 7)]
SHAPES = [(1, 1), (3, 15), (2, 16), (5, 17), (2, 31), (3, 33), (2, 63), (3, 64), (4, 65), (9, 127), (2, 128),
          (6, 129), (130, 200), (257, 300), (129, 1000)]

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 vector paths")


@pytest.fixture(scope="module", params=PATHS)
def path_lib(request):
    """(path name, the library built for that path)."""
    path = request.param
    lacking = cpu_features.missing(*fused_cpu.PATH_NEEDS[path])
    if lacking:
        pytest.skip(f"needs {' '.join(lacking)} for the {path} path (absent, or hidden by FP8RL_CPU_FLAGS_OFF)")
    lib = fused_cpu.load(fused_cpu.build(extra_flags=fused_cpu.PATH_FLAGS[path]))
    assert fused_cpu.simd_path(lib) == path, f"gcc flags {fused_cpu.PATH_FLAGS[path]} did not select {path}"
    return path, lib


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def reference(x2: torch.Tensor, block, power_of_two: bool):
    qb, scale, deqb = kernels.quantize_blocks(to_blocks(x2, block), power_of_two, True)
    m, n = x2.shape
    return from_blocks(qb, m, n), scale, from_blocks(deqb, m, n).contiguous()


def e4m3_values() -> torch.Tensor:
    """The 127 non-negative finite E4M3 values, ascending (codes 0x00 .. 0x7E)."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def tricky(shape, dtype, seed) -> torch.Tensor:
    """Rows of random magnitude (1e-42 .. 1e30: FP32 subnormal inputs, E4M3 subnormal results, the
    smallest scale), rows of exact E4M3 ties and values (scale 2**k, so that x / scale is exact), a zero
    row, -0 and signed zeros, each row's amax reached by a negative value somewhere."""
    g = torch.Generator().manual_seed(seed)
    m, n = shape
    x = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-42, 30, (m, 1), generator=g).float()
    v = e4m3_values()
    ties = torch.cat([(v[1:] + v[:-1]) / 2, v, torch.tensor([2.0**-10, 3 * 2.0**-10, 448.0])])
    for r in range(1, m, 3):  # ties and grid values times 2**k, signs random, a 448 * 2**k to fix the scale
        k = int(torch.randint(-130, 100, (1,), generator=g))
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        row = ties[torch.randint(0, len(ties), (n,), generator=g)] * sign
        row[int(torch.randint(0, n, (1,), generator=g))] = -448.0
        x[r] = row * 2.0**k
    x[0, : min(4, n)] = torch.tensor([0.0, -0.0, 1e-45, -1e-45])[: min(4, n)]
    if m > 2:
        x[2] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_bit_for_bit(path_lib, dtype, block):
    _, lib = path_lib
    for i, shape in enumerate(SHAPES):
        x = tricky(shape, dtype, seed=i)
        for power_of_two in (False, True):
            q0, s0, d0 = reference(x, block, power_of_two)
            for want_q, want_deq in ((True, True), (True, False), (False, True)):
                q, s, d = fused_cpu.quantize(x, block, power_of_two, want_deq, lib=lib, want_q=want_q)
                where = f"shape {shape}, pow2 {power_of_two}, q {want_q}, deq {want_deq}"
                assert torch.equal(s, s0), where
                assert (q is None) == (not want_q) and (q is None or torch.equal(bits(q), bits(q0))), where
                assert (d is None) == (not want_deq) and (d is None or torch.equal(bits(d), bits(d0))), where


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
def test_dequantize_bit_for_bit(path_lib, out_dtype, block):
    """Every finite code (both zeros, the subnormal codes) times scales from 2**-126 (subnormal products)
    to ~2**119, random and power-of-two."""
    _, lib = path_lib
    g = torch.Generator().manual_seed(7)
    codes = torch.cat([torch.arange(0, 127), torch.arange(128, 255)]).to(torch.uint8)
    for shape in SHAPES:
        q = codes[torch.randint(0, len(codes), shape, generator=g)].view(torch.float8_e4m3fn)
        sshape = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
        scale = 2.0 ** torch.randint(-126, 110, sshape, generator=g).float() * (1 + torch.rand(sshape, generator=g))
        scale[0, 0] = 2.0**-126
        ref = from_blocks(kernels.dequantize_blocks(to_blocks(q, block), scale, out_dtype), *shape)
        got = fused_cpu.dequantize(q, scale, block, out_dtype, lib=lib)
        assert got is not None and got.dtype == out_dtype
        assert torch.equal(bits(got), bits(ref.contiguous())), f"shape {shape}"


def test_rounding_of_every_bf16_and_random_fp32_value(path_lib):
    """Scale exactly 1 (one block with amax 448): the codes are torch's own float8 casts."""
    _, lib = path_lib
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(2)
    rand = torch.randint(0, 2**32, (300_000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    for v in (every, rand):
        v = v[torch.isfinite(v)].clamp(-448, 448)
        x = torch.cat([torch.tensor([448.0]), v]).reshape(1, -1)
        q, s, d = fused_cpu.quantize(x, (1, x.shape[1]), False, True, lib=lib)
        want = v.to(torch.float8_e4m3fn)
        assert s.item() == 1.0 and torch.equal(bits(q)[0, 1:], bits(want))
        assert torch.equal(bits(d[0, 1:]), bits(want.float()))


def test_non_finite_blocks_and_nan_codes_are_declined(path_lib):
    _, lib = path_lib
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(40, 300).to(dtype)
            x[37, 290] = bad
            for block in BLOCKS:
                assert fused_cpu.quantize(x, block, False, True, lib=lib) is None
    q = torch.zeros(5, 70, dtype=torch.uint8)
    for code in (0x7F, 0xFF):
        q[4, 69] = code
        q8 = q.view(torch.float8_e4m3fn)
        assert fused_cpu.dequantize(q8, torch.ones(5, 1), (1, 128), torch.float32, lib=lib) is None


def test_large_tensor_and_threads(path_lib):
    """8 Mi elements (the AVX-512 path streams the codes past the caches from this size), 1 and 2 threads."""
    _, lib = path_lib
    x = torch.randn(2048, 4096) * torch.logspace(-30, 30, 2048)[:, None]
    old = torch.get_num_threads()
    try:
        for block in ((1, 128), (128, 128)):
            q0, s0, d0 = reference(x, block, False)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                q, s, d = fused_cpu.quantize(x, block, False, True, lib=lib)
                assert torch.equal(bits(q), bits(q0)) and torch.equal(s, s0) and torch.equal(bits(d), bits(d0))
                q, s, _ = fused_cpu.quantize(x, block, False, False, lib=lib)
                assert torch.equal(bits(q), bits(q0))
                assert torch.equal(fused_cpu.dequantize(q, s, block, torch.float32, lib=lib), d0)
    finally:
        torch.set_num_threads(old)


def test_default_build_follows_the_cpu_flags(monkeypatch):
    """The default library runs the best path this CPU has; FP8RL_CPU_FLAGS_OFF steps it down."""
    best = next(p for p in PATHS if not cpu_features.missing(*fused_cpu.PATH_NEEDS[p]))
    assert fused_cpu.simd_path(fused_cpu.load(fused_cpu.build(extra_flags=fused_cpu.default_flags()))) == best
    monkeypatch.setenv(cpu_features.ENV_OFF, "avx512bw")
    assert fused_cpu.default_flags() == fused_cpu.PATH_FLAGS["avx2"]
    monkeypatch.setenv(cpu_features.ENV_OFF, "avx2 avx512f")
    assert fused_cpu.default_flags() == fused_cpu.PATH_FLAGS["scalar"]
