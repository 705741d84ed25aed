"""The formats' emulated GEMMs and Fp8Linear / the generation engine's fused linears in every format.

References are float64 contractions of operands dequantized by the public quantizers (whose bits
test_formats_quant.py pins against an independent reference). Tolerance: the emulated GEMM sums K exact
FP32 products in FP32 (error <= (K - 1) * 2^-24 * sum |a||b|, the standard bound for any summation order),
then rescales once by fl(scale_a * scale_b) (two roundings), while the reference's dequantized operands
carry one rounding each (fl(body * scale)): |C - C64| <= (K + 6) * 2^-24 * (|A| @ |B|^T). A layer's output
adds the FP32 bias add and one rounding to the output dtype (2^-24 for FP32, 2^-8 for BF16). Operands are
in the normal FP32 range (no underflow term), so the bound holds on any CPU and BLAS.
"""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.fp8 import (
    Fp8Linear,
    Fp8Weight,
    Quantization,
    QuantWeight,
    dequantize_mxfp8,
    dequantize_nvfp4,
    dequantize_tensorwise,
    fp8_linear,
    lowp,
    quantize_mxfp8,
    quantize_nvfp4,
    quantize_tensorwise,
    quantize_weight,
    resolve_scale_format,
)
from fp8rl_core.fp8.formats import FORMATS


def _tw(pow2):
    return lambda t: dequantize_tensorwise(*quantize_tensorwise(t, power_of_two=pow2))


def _mx(dim):
    return lambda t: dequantize_mxfp8(*quantize_mxfp8(t, dim), dim)


def _nv(block):
    return lambda t: dequantize_nvfp4(*quantize_nvfp4(t, block), block)


# format, scale_format -> (rows: X/dY along the last dim, cols: wgrad operands along tokens, W fprop, W dgrad)
REFS = {
    ("tensorwise", "fp32"): (_tw(False), _tw(False), _tw(False), _tw(False)),
    ("tensorwise", "pow2"): (_tw(True), _tw(True), _tw(True), _tw(True)),
    ("mxfp8", "e8m0"): (_mx(-1), _mx(0), _mx(-1), _mx(0)),
    ("nvfp4", "e4m3_fp32"): (_nv((1, 16)), _nv((16, 1)), _nv((16, 16)), _nv((16, 16))),
}


def check_close(got, ref, ref_abs, k, out_ulp=2.0**-24):
    tol = (k + 6) * 2.0**-24 * ref_abs * (1 + out_ulp) + out_ulp * ref.abs()
    err = (got.double() - ref).abs()
    assert torch.all(err <= tol), f"max err/tol {(err / tol).max().item():.3g}"


@pytest.mark.parametrize("fmt, sf", list(REFS))
def test_emulated_gemms_vs_float64(fmt, sf):
    """fprop, dgrad, wgrad GEMMs of lowp on each format's operands, against float64 on the dequantized
    operands (which equal the public dequantizers' output bit for bit)."""
    g = torch.Generator().manual_seed(1)
    m, k, n = 37, 100, 50
    x, w, dy = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05, torch.randn(m, n, generator=g)
    kern = FORMATS[fmt].kernels()
    rows, cols, w_f, w_d = REFS[(fmt, sf)]
    qx = kern.quantize_operand(x, 1, scale_format=sf, check_finite=True, name="x")
    qdy = kern.quantize_operand(dy, 1, scale_format=sf, check_finite=True, name="dy")
    qdy_c = kern.quantize_operand(dy, 0, scale_format=sf, check_finite=True, name="dy")
    qx_c = kern.quantize_operand(x, 0, scale_format=sf, check_finite=True, name="x")
    qw_f, qw_d = kern.quantize_weight(w, scale_format=sf, check_finite=True, name="w", dgrad=True)
    for q, ref in ((qx, rows(x)), (qdy, rows(dy)), (qdy_c, cols(dy)), (qx_c, cols(x)), (qw_f, w_f(w)),
                   (qw_d, w_d(w))):
        assert torch.equal(q.dequantized(), ref)
    for got, a, b, kk in ((lowp.mm(qx, qw_f.t()), rows(x), w_f(w).T, k),  # fprop, K contracted
                          (lowp.mm(qdy, qw_d), rows(dy), w_d(w), n),  # dgrad, N contracted
                          (lowp.mm(qdy_c.t(), qx_c), cols(dy).T, cols(x), m)):  # wgrad, M contracted
        a, b = a.double(), b.double()
        assert got.dtype == torch.float32
        check_close(got, a @ b, a.abs() @ b.abs(), kk)


@pytest.mark.parametrize("fmt, sf", list(REFS))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fp8linear_forward_backward_vs_float64(fmt, sf, x_dtype):
    torch.manual_seed(0)
    m, k, n = 40, 72, 48  # partial blocks of 32 and 16 along every dim
    layer = Fp8Linear(k, n, quant=Quantization(format=fmt, scale_format=sf))
    with torch.no_grad():
        layer.bias.normal_()
    assert (layer.format, layer.scale_format) == (fmt, sf) and f"fp8={fmt}" in repr(layer)
    x = torch.randn(2, m // 2, k, dtype=x_dtype, requires_grad=True)  # leading dims flattened into M
    dy = torch.randn(2, m // 2, n, dtype=x_dtype)
    y = layer(x)
    y.backward(dy)
    assert y.dtype == x.grad.dtype == x_dtype and layer.weight.grad.dtype == torch.float32
    rows, cols, w_f, w_d = REFS[(fmt, sf)]
    x2, dy2, w = x.detach().reshape(m, k), dy.reshape(m, n), layer.weight.detach()
    ulp = 2.0**-24 if x_dtype == torch.float32 else 2.0**-8
    a, b, bias = rows(x2).double(), w_f(w).double(), layer.bias.double()
    check_close(y.reshape(m, n), a @ b.T + bias, a.abs() @ b.abs().T + bias.abs(), k, ulp)
    a, b = rows(dy2).double(), w_d(w).double()
    check_close(x.grad.reshape(m, k), a @ b, a.abs() @ b.abs(), n, ulp)
    a, b = cols(dy2).double(), cols(x2).double()
    check_close(layer.weight.grad, a.T @ b, a.abs().T @ b.abs(), m)
    assert torch.equal(layer.bias.grad, dy2.float().sum(0))


def test_block128_through_the_generic_path_equals_its_own_path(monkeypatch):
    """block128.py + lowp reproduce Fp8Linear's block128 path (the emulated executor) bit for bit."""
    monkeypatch.setenv("FP8RL_GEMM", "emulated")  # lowp's GEMM is the emulation, whatever this CPU's default
    torch.manual_seed(0)
    layer = Fp8Linear(200, 130)
    x = torch.randn(9, 200, requires_grad=True)
    dy = torch.randn(9, 130)
    layer(x).backward(dy)
    w = lowp.quantize_weight(layer.weight, None, format="block128", dgrad=True)
    y = lowp.forward(x.detach(), w, check_finite=True)
    y += layer.bias.detach()
    assert torch.equal(y, layer(x).detach())
    assert torch.equal(lowp.grad_input(dy, w, check_finite=True), x.grad)
    assert torch.equal(lowp.grad_weight(dy, x.detach(), "block128", "fp32", check_finite=True), layer.weight.grad)


def test_default_is_block128_and_knobs_are_validated():
    layer = Fp8Linear(64, 32)
    assert (layer.format, layer.scale_format, layer.power_of_two) == ("block128", "fp32", False)
    assert isinstance(layer.quantized_weight(), Fp8Weight)
    assert Fp8Linear(64, 32, quant=Quantization(scale_format="pow2")).scale_format == "pow2"
    tw = Fp8Linear(64, 32, quant=Quantization(format="tensorwise", scale_format="pow2"))
    assert tw.power_of_two and isinstance(tw.quantized_weight(), QuantWeight)
    assert Fp8Linear(64, 32, quant=Quantization(format="mxfp8", scale_format="e8m0")).scale_format == "e8m0"
    with pytest.raises(ValueError, match="not valid for format 'nvfp4'"):
        Fp8Linear(64, 32, quant=Quantization(format="nvfp4", scale_format="pow2"))
    with pytest.raises(ValueError, match="not valid for format 'mxfp8'; valid: e8m0"):  # the default is fp32
        Fp8Linear(64, 32, quant=Quantization(format="mxfp8"))
    with pytest.raises(ValueError, match="unknown format"):
        Fp8Linear(64, 32, quant=Quantization(format="fp6"))
    with pytest.raises(TypeError):  # the knobs are Quantization's fields, not keywords of the layer
        Fp8Linear(64, 32, power_of_two=True)


@pytest.mark.parametrize("fmt", ["tensorwise", "mxfp8", "nvfp4"])
def test_weight_cache_and_non_finite(fmt):
    torch.manual_seed(0)
    layer = Fp8Linear(64, 32, quant=Quantization(format=fmt, scale_format=resolve_scale_format(fmt)))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    q1 = layer.quantized_weight()
    assert layer.quantized_weight() is q1 and q1.dgrad is not None
    layer(torch.randn(3, 64)).sum().backward()
    opt.step()
    q2 = layer.quantized_weight()
    assert q2 is not q1 and not torch.equal(q2.fprop.body, q1.fprop.body)
    x = torch.randn(3, 64)
    x[0, 0] = float("inf")
    with pytest.raises(ValueError, match="x: non-finite"):
        layer(x)


@pytest.mark.parametrize("fmt, sf", [("tensorwise", "fp32"), ("tensorwise", "pow2"), ("mxfp8", "e8m0"),
                                     ("nvfp4", "e4m3_fp32")])
def test_fused_generation_weights_equal_the_trainers_per_projection_quantization(fmt, sf):
    """fuse_linear quantizes each projection on its own (no padding, no block or tensor scale across two
    projections): its weight is the trainer's per-projection Q(W), its output that of per-projection GEMMs."""
    from fp8rl_core.engines.native_gen import fuse_linear, quantized_linear

    torch.manual_seed(0)
    spec = Quantization(format=fmt, scale_format=sf)
    k, sizes = 64, (40, 24, 24)  # not multiples of 16 or 32 at the shard boundaries
    layers = [Fp8Linear(k, n, bias=True, quant=spec, quantize_dtype=torch.bfloat16) for n in sizes]
    with torch.no_grad():
        for lin, f in zip(layers, (1.0, 3.0, 0.3)):
            lin.weight.mul_(f)
    mats = [lin.weight.detach().bfloat16() for lin in layers]
    biases = [lin.bias.detach().bfloat16() for lin in layers]
    fused = fuse_linear(mats, biases, spec)
    assert fused.starts == (0, 40, 64) and fused.sizes == sizes and isinstance(fused.weight, QuantWeight)
    rows = torch.split(fused.weight.fprop.body, list(sizes))
    scales = fused.weight.fprop.scale
    for i, lin in enumerate(layers):
        own = lin.quantized_weight().fprop
        assert torch.equal(rows[i], own.body)
        if own.scale is not None:
            assert torch.equal(scales[fused.starts[i]:fused.starts[i] + sizes[i]], own.scale.expand(sizes[i]))
    if fmt == "tensorwise":
        assert len(set(scales.tolist())) == 3  # one tensor scale per projection
    x = torch.randn(2, 5, k, dtype=torch.bfloat16)
    y = fused(x)
    assert y.shape == (2, 5, sum(sizes)) and y.dtype == torch.bfloat16
    for part, mat, b in zip(fused.split(y), mats, biases):
        single = quantized_linear(mat, spec, b)
        ref = single(x)
        assert part.shape == ref.shape
        torch.testing.assert_close(part.float(), ref.float(), rtol=2**-7, atol=1e-5)  # GEMM order only
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        layers[0].bias.copy_(biases[0].float())  # the engine holds the BF16 bias
        y_train = layers[0](x.float())
    torch.testing.assert_close(y_train.float(), fused.split(y)[0].float(), rtol=2**-7, atol=1e-5)


def test_block128_fusion_and_inference_helpers_unchanged():
    from fp8rl_core.engines.native_gen import fuse_linear, quantized_linear

    torch.manual_seed(0)
    mats = [torch.randn(192, 128).bfloat16(), torch.randn(96, 128).bfloat16()]
    fused = fuse_linear(mats, [None, None], Quantization())
    assert fused.starts == (0, 256) and isinstance(fused.weight, Fp8Weight)  # padded to 128 rows per shard
    head = quantized_linear(mats[0], Quantization(scale_format="pow2"))
    w = quantize_weight(mats[0], quant=Quantization(scale_format="pow2"))
    assert torch.equal(head.weight.q.view(torch.uint8), w.q.view(torch.uint8)) and torch.equal(head.weight.scale,
                                                                                                  w.scale)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert torch.equal(head(x), fp8_linear(x, w, power_of_two=True))
    assert isinstance(quantize_weight(mats[0], quant=Quantization(format="nvfp4", scale_format="e4m3_fp32")),
                      QuantWeight)
