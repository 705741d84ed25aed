"""The arithmetic E4M3 rounding/decoding kernels against torch's native float8 casts, exhaustively."""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.fp8 import kernels
from fp8rl_core.fp8.kernels import block_scales, e4m3_to_float, round_to_e4m3


def all_e4m3_values() -> torch.Tensor:
    """The 254 finite E4M3 values (both zeros included), as float32, sorted."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)].sort().values


def test_decode_matches_native_cast_for_all_256_codes():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    want, got = codes.float(), e4m3_to_float(codes)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    finite = ~torch.isnan(want)
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))  # signed zeros too


def test_rounding_matches_native_cast_at_midpoints_and_neighbours():
    vals = all_e4m3_values()
    mids = (vals[1:] + vals[:-1]) / 2  # exact in FP32: the ties
    probes = [vals, mids, torch.nextafter(mids, torch.tensor(-1e9)), torch.nextafter(mids, torch.tensor(1e9))]
    g = torch.Generator().manual_seed(0)
    probes.append((torch.rand(200_000, generator=g) * 2 - 1) * 448 * torch.rand(200_000, generator=g) ** 8)
    probes.append(torch.tensor([0.0, -0.0, 1e-45, -1e-40, 2.0**-10, 3 * 2.0**-11, 448.0, -448.0]))
    v = torch.cat(probes).clamp(-448, 448)
    want = v.to(torch.float8_e4m3fn).float()
    got = round_to_e4m3(v)
    assert torch.equal(got, want), f"{(got != want).sum().item()} mismatches, e.g. {v[got != want][:5]}"
    assert torch.equal(got.to(torch.float8_e4m3fn).float(), got), "results lie on the E4M3 grid"


def test_power_of_two_scales_round_up():
    amax = torch.tensor([0.0, 448.0, 449.0, 1.0, 3e-30, 1e30, float("nan"), float("inf")])
    s = block_scales(amax, power_of_two=True)
    assert s[0] == 1.0 and s[1] == 1.0 and s[2] == 2.0 and s[3] == 2.0**-8
    assert s[4] >= 3e-30 / 448 and s[4] < 2 * 3e-30 / 448
    assert torch.isnan(s[6]) and torch.isinf(s[7])


@pytest.mark.slow
def test_compiled_kernels_are_bit_identical():
    """torch.compile must not change a bit (e.g. by turning x / scale into x * (1 / scale))."""
    from fp8rl_core.fp8 import Fp8Linear, dequantize_blockwise, quantize_blockwise

    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 1000, generator=g) * 10.0 ** torch.randint(-6, 4, (300, 1), generator=g)
    cases = [(b, p) for b in ((1, 128), (128, 128)) for p in (False, True)]
    eager = [quantize_blockwise(x, b, power_of_two=p) for b, p in cases]
    layer = Fp8Linear(384, 256, dtype=torch.bfloat16)
    xb = torch.randn(2, 129, 384, generator=g).bfloat16()
    with torch.no_grad():
        y_eager = layer(xb)
    kernels.set_compile(True)
    try:
        for (b, p), (q0, s0) in zip(cases, eager):
            q1, s1 = quantize_blockwise(x, b, power_of_two=p)
            assert torch.equal(q1.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s1, s0), (b, p)
            kernels.set_compile(False)
            d0 = dequantize_blockwise(q0, s0, b)
            kernels.set_compile(True)
            assert torch.equal(dequantize_blockwise(q1, s1, b), d0), (b, p)
        with torch.no_grad():
            assert torch.equal(layer(xb), y_eager)
    finally:
        kernels.set_compile(False)
