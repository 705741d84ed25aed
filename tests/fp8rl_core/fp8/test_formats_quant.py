"""MXFP8, NVFP4 and tensorwise quantizers against an independent per-element reference, bit for bit.

The reference below is written from the definitions (docs/design.md, issue 23), in plain Python floats and
numpy float32 scalars (IEEE FP32 arithmetic, correctly rounded, subnormals kept), with E4M3 and E2M1
rounding done by searching the format's value table (nearest, ties to the even code): it never calls the
implementation. Scales are compared exactly; elements are compared as values (+0 == -0).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8rl_core.fp8 import (
    FORMATS,
    dequantize_mxfp8,
    dequantize_nvfp4,
    dequantize_tensorwise,
    get_format,
    quantize_mxfp8,
    quantize_nvfp4,
    quantize_tensorwise,
    resolve_scale_format,
)

f32 = np.float32


def _e4m3_table() -> list[tuple[float, int]]:
    """(value, code) for every finite non-negative E4M3 (fn) value: bias 7, no inf, 0x7F is NaN."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append((m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), code))
    return out


E4M3 = _e4m3_table()
E2M1 = [(v, i) for i, v in enumerate((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))]


def round_table(x: float, table: list[tuple[float, int]]) -> float:
    """Nearest table value to |x| (ties to the even code), saturating at the largest; sign restored."""
    mag = min(abs(x), table[-1][0])
    best = min(table, key=lambda vc: (abs(vc[0] - mag), vc[1] & 1))
    return math.copysign(best[0], x)


def e4m3(x: float) -> float:
    return round_table(x, E4M3)


def ceil_pow2_exponent(q: float) -> int:
    """The smallest integer e with 2^e >= q > 0 (exact, via frexp)."""
    m, ex = math.frexp(q)  # q = m * 2^ex, m in [0.5, 1)
    return ex - 1 if m == 0.5 else ex


def ref_mxfp8_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [R, L] float32 -> (q values [R, L] float64, scale [R, ceil(L/32)] float64), blocks along L."""
    r, length = x.shape
    nb = -(-length // 32)
    q, s = np.zeros((r, length)), np.zeros((r, nb))
    for i in range(r):
        for j in range(nb):
            blk = [float(v) for v in x[i, 32 * j:32 * j + 32]]
            amax = max(abs(v) for v in blk)
            qa = float(f32(amax) / f32(448.0))
            e = -127 if qa == 0 else max(-127, min(127, ceil_pow2_exponent(qa)))
            s[i, j] = 2.0**e
            for t, v in enumerate(blk):
                y = float(f32(v) / f32(2.0**e))
                q[i, 32 * j + t] = e4m3(max(-448.0, min(448.0, y)))
    return q, s


def ref_nvfp4(x: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, float]:
    """x [M, K] float32 -> (dequantized [M, K] float64, block scales b [Mb, Kb], S)."""
    (m, k), (br, bc) = x.shape, block
    amax_t = max(abs(float(v)) for v in x.flat)
    s = 1.0 if amax_t == 0 else float(f32(amax_t) / f32(2688.0))
    six_s = f32(6.0) * f32(s)
    mb, kb = -(-m // br), -(-k // bc)
    b, deq = np.zeros((mb, kb)), np.zeros((m, k))
    for i in range(mb):
        for j in range(kb):
            blk = x[br * i:br * i + br, bc * j:bc * j + bc]
            amax_b = max(abs(float(v)) for v in blk.flat)
            ratio = 0.0 if amax_b == 0 else (448.0 if six_s == 0 else float(f32(amax_b) / six_s))
            b[i, j] = bb = e4m3(min(ratio, 448.0))
            bs = float(f32(bb) * f32(s))
            for (u, w), v in np.ndenumerate(blk):
                vv = 0.0 if bs == 0 else float(f32(v) / f32(bs))
                code = round_table(vv, E2M1)
                deq[br * i + u, bc * j + w] = float(f32(f32(code) * f32(bb)) * f32(s))
    return deq, b, s


def ref_tensorwise(x: np.ndarray, pow2: bool) -> tuple[np.ndarray, float]:
    amax = max(abs(float(v)) for v in x.flat)
    scale = 1.0 if amax == 0 else max(float(f32(amax) / f32(448.0)), 2.0**-126)
    if pow2:
        scale = 2.0 ** ceil_pow2_exponent(scale)
    q = np.vectorize(lambda v: e4m3(max(-448.0, min(448.0, float(f32(v) / f32(scale))))))(x)
    return q, scale


def cases() -> dict[str, torch.Tensor]:
    """Random and edge-case inputs (FP32 values; a BF16 case is built from them)."""
    g = torch.Generator().manual_seed(0)
    out = {"random": torch.randn(6, 70, generator=g), "wide_range": torch.randn(5, 50, generator=g)
           * torch.logspace(-6, 6, 50)}
    x = torch.randn(4, 64, generator=g)
    x[1] = 0.0  # all-zero rows: zero blocks in every layout
    x[2, :32] = 0.0
    x[0, 5] = 3e4  # an outlier
    out["zeros_outlier"] = x
    t = torch.randn(3, 48, generator=g) * 2.0**-130  # FP32 subnormals: clamped/tiny scales, not flushed
    t[0, :16] = torch.randn(16, generator=g) * 1e-42
    t[2] *= 2.0**100  # normal values beside them
    out["tiny"] = t
    p = torch.randn(2, 64, generator=g).clamp(-400, 400)
    p[0, 3], p[1, 40], p[1, 10] = 448.0 * 8, -448.0 * 2.0**-3, 448.0 * 2.0**20  # amax = 448 * 2^k exactly
    out["pow2_amax"] = p
    # E2M1 ties for NVFP4: S = 1 (tensor amax 2688), a block of amax 6 -> b = 1, so v = x exactly
    ties = torch.zeros(2, 32)
    ties[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5,
                                 -3.5, -5.0, 0.3])
    ties[0, 16:32] = 2688.0
    ties[1, :16] = 6.0 * 1.06  # block amax / 6 rounds down in E4M3 (b = 1): 6.36 saturates to 6
    ties[1, 1:4] = torch.tensor([6.1, -6.3, 5.9])
    ties[1, 16:] = torch.linspace(-1, 1, 16)
    out["ties_saturation"] = ties
    out["all_zero"] = torch.zeros(3, 40)
    out["partial_odd"] = torch.randn(7, 33, generator=g)
    return out


CASES = cases()


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("dim", [-1, 0])
def test_mxfp8_matches_reference(name, bf16, dim):
    x = CASES[name].bfloat16() if bf16 else CASES[name]
    q, s = quantize_mxfp8(x, dim)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    xr = x.float().numpy()
    q_ref, s_ref = ref_mxfp8_rows(xr if dim == -1 else xr.T)
    if dim == 0:
        q_ref, s_ref = q_ref.T, s_ref.T
    assert tuple(s.shape) == s_ref.shape  # [M, ceil(K/32)] (dim -1) or [ceil(M/32), K] (dim 0)
    assert np.array_equal(s.float().double().numpy(), s_ref)
    assert np.array_equal(q.float().double().numpy(), q_ref)
    assert torch.equal(dequantize_mxfp8(q, s, dim).double(), torch.from_numpy(q_ref * np.repeat(
        s_ref, 32, axis=1 if dim == -1 else 0)[: x.shape[0], : x.shape[1]]))


def test_mxfp8_exponent_edges():
    """amax = 448 * 2^k keeps e = k (no round-up); one ulp above rounds up; zero -> 2^-127; clamp at -127."""
    x = torch.zeros(5, 32)
    x[0, 0] = 448.0 * 2.0**3
    x[1, 0] = float(np.nextafter(f32(448.0 * 2.0**3), f32(1e9)))
    x[3, 0] = 2.0**-149  # the smallest subnormal: e = -127
    x[4, 0] = 448.0 * 2.0**-126  # q_amax = 2^-126 exactly
    _, s = quantize_mxfp8(x)
    assert s[:, 0].tolist() == [2.0**3, 2.0**4, 2.0**-127, 2.0**-127, 2.0**-126]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("block", [(1, 16), (16, 16), (16, 1)])
def test_nvfp4_matches_reference(name, bf16, block):
    x = CASES[name].bfloat16() if bf16 else CASES[name]
    codes, b, s = quantize_nvfp4(x, block)
    assert codes.shape == x.shape and b.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.dim() == 0
    deq_ref, b_ref, s_ref = ref_nvfp4(x.float().numpy(), block)
    assert s.item() == s_ref
    assert np.array_equal(b.float().double().numpy(), b_ref)
    assert np.array_equal(dequantize_nvfp4(codes, b, s, block).double().numpy(), deq_ref)


def test_nvfp4_ties_and_saturation_explicitly():
    x = CASES["ties_saturation"]
    codes, b, s = quantize_nvfp4(x)
    assert s.item() == 1.0 and b[0, 0].float().item() == 1.0 and b[1, 0].float().item() == 1.0
    v = dequantize_nvfp4(codes, b, s)
    assert v[0, :16].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -1.0, -1.0, -2.0, -2.0, -4.0,
                                  -4.0, 0.5]
    assert v[1, :4].tolist() == [6.0, 6.0, -6.0, 6.0]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("pow2", [False, True])
def test_tensorwise_matches_reference(name, bf16, pow2):
    x = CASES[name].bfloat16() if bf16 else CASES[name]
    q, s = quantize_tensorwise(x, power_of_two=pow2)
    q_ref, s_ref = ref_tensorwise(x.float().numpy(), pow2)
    assert s.dim() == 0 and s.item() == s_ref
    assert np.array_equal(q.float().double().numpy(), q_ref)
    assert torch.equal(dequantize_tensorwise(q, s), q.float() * s)


@pytest.mark.parametrize("quantize", [
    lambda x, **kw: quantize_mxfp8(x, **kw), lambda x, **kw: quantize_nvfp4(x, **kw),
    lambda x, **kw: quantize_nvfp4(x, (16, 16), **kw), lambda x, **kw: quantize_tensorwise(x, **kw)])
def test_non_finite_raises_naming_the_tensor_or_propagates(quantize):
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="my_act: non-finite"):
        quantize(x, name="my_act")
    out = quantize(x, check_finite=False)  # as block128: the NaN reaches the scales
    assert any(not bool(torch.isfinite(t.float()).all()) for t in out[1:])


def test_registry():
    assert list(FORMATS) == ["block128", "tensorwise", "mxfp8", "nvfp4"]
    assert {n: f.scale_formats for n, f in FORMATS.items()} == {
        "block128": ("fp32", "pow2"), "tensorwise": ("fp32", "pow2"), "mxfp8": ("e8m0",), "nvfp4": ("e4m3_fp32",)}
    assert [f.element_bits for f in FORMATS.values()] == [8, 8, 8, 4]
    assert FORMATS["block128"].weight_bytes((256, 300)) == 256 * 300 + 4 * 2 * 3
    assert FORMATS["mxfp8"].weight_bytes((64, 70)) == 64 * 70 + 64 * 3
    assert FORMATS["nvfp4"].weight_bytes((32, 33)) == 32 * 33 // 2 + 2 * 3 + 4
    assert FORMATS["nvfp4"].act_bytes((3, 32)) == 48 + 6 + 4 and FORMATS["tensorwise"].weight_bytes((2, 2)) == 8
    assert FORMATS["mxfp8"].training_weight_copies == 2
    assert all(f.blocks and hasattr(f.kernels(), "quantize_operand") for f in FORMATS.values())
    assert resolve_scale_format("mxfp8") == "e8m0" and resolve_scale_format("tensorwise", "pow2") == "pow2"
    with pytest.raises(ValueError, match="valid: e8m0"):
        resolve_scale_format("mxfp8", "fp32")
    with pytest.raises(ValueError, match="unknown format"):
        get_format("fp6")


def test_registry_imports_without_torch():
    """The config layer and the memory plan read FORMATS without importing torch (the package loads lazily)."""
    import subprocess
    import sys

    code = ("import sys; from fp8rl_core.fp8.formats import FORMATS; "
            "assert FORMATS['nvfp4'].element_bits == 4; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
