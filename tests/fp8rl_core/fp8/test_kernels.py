"""The block kernels: power-of-two scales from bits, and torch.compile giving the eager bits."""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.fp8 import kernels
from fp8rl_core.fp8.kernels import block_scales


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
