"""quantize_blockwise / dequantize_blockwise against an independent loop-over-blocks reference.

The reference below shares no code with fp8rl_core.fp8: it walks the blocks one by one, computes the
scale with numpy float32 arithmetic, and rounds to E4M3 with its own round-to-nearest-even on the
E4M3 grid (in float64, exact for FP32 inputs), so it also checks torch's float8 cast and the clamp.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8rl_core.fp8 import E4M3_MAX, dequantize_blockwise, quantize_blockwise


def e4m3_round(v: np.ndarray) -> np.ndarray:
    """Round float64 values to the E4M3 (fn) grid, nearest-even, saturating at +-448."""
    a = np.abs(v)
    exp = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    ulp = np.exp2(np.maximum(exp, -6.0) - 3.0)  # 3 mantissa bits; subnormals below 2**-6 (ulp 2**-9)
    r = np.round(a / ulp) * ulp  # np.round is half-to-even; a / ulp is exact (power-of-two divisor)
    return np.sign(v) * np.minimum(r, E4M3_MAX)


def reference_quantize(x: torch.Tensor, block: tuple[int, int], power_of_two: bool = False):
    """Loop over blocks of the 2-D view of x; returns (q as float64 ndarray, scale as float32 ndarray)."""
    x2 = x.reshape(-1, x.shape[-1]).float().numpy()
    (m, n), (br, bc) = x2.shape, block
    q = np.zeros((m, n), dtype=np.float64)
    scale = np.zeros((math.ceil(m / br), math.ceil(n / bc)), dtype=np.float32)
    for bi, i in enumerate(range(0, m, br)):
        for bj, j in enumerate(range(0, n, bc)):
            blk = x2[i : i + br, j : j + bc]
            amax = np.float32(np.abs(blk).max())
            s = np.float32(1.0) if amax == 0 else np.float32(amax / np.float32(448.0))
            if power_of_two and amax != 0:
                s = np.float32(2.0 ** math.ceil(math.log2(float(s))))
            scale[bi, bj] = s
            scaled = (blk / s).astype(np.float32)  # IEEE float32 division, as documented
            q[i : i + br, j : j + bc] = e4m3_round(np.clip(scaled.astype(np.float64), -448.0, 448.0))
    return q, scale


def random_input(shape, dtype, seed: int) -> torch.Tensor:
    """Gaussian values with per-row magnitudes spread over 1e-8 .. 1e4, plus zero rows/blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x2 = x.view(-1, shape[-1])
    mags = 10.0 ** torch.empty(x2.shape[0], 1, dtype=torch.float64).uniform_(-8, 4, generator=g)
    x2 *= mags
    x2 *= torch.rand(x2.shape, generator=g, dtype=torch.float64) ** 3 + 0.01  # wide in-block range
    if x2.shape[0] > 2:
        x2[1] = 0.0  # an all-zero row: zero blocks
    if x2.shape[1] > 130:
        x2[:, :128] *= (torch.arange(x2.shape[0]) % 3 != 0).unsqueeze(1)  # some zero 1x128 blocks
    return x.to(dtype)


SHAPES = [(1, 1), (1, 128), (127, 129), (128, 256), (300, 1000), (2, 3, 200)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCKS = [(1, 128), (128, 128), (128, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block", BLOCKS)
def test_bit_exact_vs_reference(shape, dtype, block):
    if block == (128, 1) and shape == (300, 1000):
        shape = (300, 130)  # keep the loop reference fast
    x = random_input(shape, dtype, seed=hash((shape, block)) % 1000)
    q, scale = quantize_blockwise(x, block)
    q_ref, s_ref = reference_quantize(x, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and tuple(scale.shape) == s_ref.shape
    np.testing.assert_array_equal(scale.numpy(), s_ref)
    np.testing.assert_array_equal(q.reshape(-1, x.shape[-1]).double().numpy(), q_ref)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_power_of_two_scales(block):
    x = random_input((200, 300), torch.float32, seed=7)
    q, scale = quantize_blockwise(x, block, power_of_two=True)
    q_ref, s_ref = reference_quantize(x, block, power_of_two=True)
    np.testing.assert_array_equal(scale.numpy(), s_ref)
    np.testing.assert_array_equal(q.double().numpy(), q_ref)
    mant, _ = np.frexp(scale.numpy())
    assert np.all(mant == 0.5), "every scale must be an exact power of two"
    _, s_plain = quantize_blockwise(x, block)
    assert torch.all(scale >= s_plain) and torch.all(scale < 2 * s_plain), "rounded up by less than 2x"


def test_values_at_and_beyond_448_are_clamped():
    # the block max lands at exactly 448; neighbours whose x / scale rounds above 448 must saturate, not NaN
    x = torch.tensor([[3.0, -3.0, 2.9999998, 1e-30] + [0.1] * 124], dtype=torch.float32)
    q, scale = quantize_blockwise(x)
    assert scale.item() == np.float32(3.0) / np.float32(448.0)
    assert q[0, 0].float().item() == 448.0 and q[0, 1].float().item() == -448.0
    assert not torch.isnan(q.float()).any()
    # without the clamp the cast would overflow: an input whose x/scale exceeds 448 by rounding
    big = torch.full((1, 128), 7.0) * torch.linspace(0.5, 1.0, 128)
    q2, s2 = quantize_blockwise(big)
    assert (big / s2).max() >= 448.0 and q2.float().abs().max() == 448.0


def test_zero_blocks_get_unit_scale():
    x = torch.zeros(130, 260)
    x[0, 0] = 5.0
    q, scale = quantize_blockwise(x, (128, 128))
    assert scale[0, 0] == np.float32(5.0) / np.float32(448.0)
    assert torch.all(scale.flatten()[1:] == 1.0)
    assert torch.count_nonzero(q.float()) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_roundtrip_error_within_e4m3(dtype, block):
    """|x - deq(q(x))| <= 2**-4 |x| (3 mantissa bits, round-to-nearest) for normal E4M3 results, and
    <= 2**-10 * scale (half the subnormal step 2**-9) below 2**-6; hence always <= 2**-4 * block amax.
    A factor (1 + 2**-20) covers the FP32 roundings of x / scale and q * scale."""
    x = random_input((300, 1000), dtype, seed=3).float()
    q, scale = quantize_blockwise(x.to(dtype), block)
    deq = dequantize_blockwise(q, scale, block)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    s_full = scale.repeat_interleave(block[0], 0)[: x.shape[0]].repeat_interleave(block[1], 1)[:, : x.shape[1]]
    bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s_full) * (1 + 2.0**-20)
    err = (deq - x).abs()
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item()}"
    assert torch.all(err <= 2.0**-4 * 448.0 * s_full * (1 + 2.0**-20))
    assert err.max() > 0, "a quantizer that returns its input unchanged must fail this test"


def test_dequantize_out_dtype_and_shape():
    x = torch.randn(2, 5, 260, dtype=torch.bfloat16)
    q, scale = quantize_blockwise(x)
    assert tuple(scale.shape) == (10, 3)
    y = dequantize_blockwise(q, scale, (1, 128), out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y, dequantize_blockwise(q, scale, (1, 128)).to(torch.bfloat16))  # one rounding, from FP32
    with pytest.raises(ValueError, match="scale"):
        dequantize_blockwise(q, scale[:, :2], (1, 128))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rejected_with_name(bad):
    x = torch.randn(4, 200, dtype=torch.bfloat16)
    x[2, 150] = bad
    with pytest.raises(ValueError, match="hidden_states.*non-finite"):
        quantize_blockwise(x, name="hidden_states")
    q, scale = quantize_blockwise(x, check_finite=False)  # the opt-out does not raise
    assert q.shape == x.shape


def test_invalid_arguments():
    with pytest.raises(ValueError, match="dtype"):
        quantize_blockwise(torch.ones(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="block"):
        quantize_blockwise(torch.ones(4, 4), (0, 128))
    with pytest.raises(ValueError, match="scalar"):
        quantize_blockwise(torch.tensor(1.0))
