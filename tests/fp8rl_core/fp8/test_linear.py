"""Fp8Linear forward/dgrad/wgrad against float64 formulas on the quantized operands, and against BF16.

Tight references: the operands are quantized with quantize_blockwise (bit-exact vs its own reference in
test_quant.py), dequantized exactly in float64 (q * scale), and contracted in float64. The FP32-
accumulation bound of test_gemm.py applies: |err| <= (K + 4) * 2**-24 * (|A| @ |B|^T) (the default
"emulated" executor; the blockwise one is tighter), plus the FP32 bias add and one rounding of the
result to the output dtype (unit roundoff 2**-8 for bf16).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from fp8rl_core.fp8 import (
    Fp8Linear,
    Quantization,
    dequantize_blockwise,
    fp8_linear,
    quantize_blockwise,
    quantize_weight,
)

POW2 = Quantization(scale_format="pow2")

ACT, WGT, COL = (1, 128), (128, 128), (128, 1)


def deq64(x: torch.Tensor, block) -> torch.Tensor:
    """Quantize x, then dequantize exactly in float64."""
    q, s = quantize_blockwise(x, block)
    s_full = s.double().repeat_interleave(block[0], 0)[: q.shape[0]].repeat_interleave(block[1], 1)[:, : q.shape[1]]
    return q.double() * s_full


def check_close(got: torch.Tensor, ref: torch.Tensor, ref_abs: torch.Tensor, k: int, out_ulp: float) -> None:
    tol = (k + 5) * 2.0**-24 * ref_abs * (1 + out_ulp) + out_ulp * ref.abs()
    err = (got.double() - ref).abs()
    assert torch.all(err <= tol), f"max err/tol {(err / tol).max().item():.3g}"


def run_layer(m, k, n, x_dtype, w_dtype, seed=0):
    torch.manual_seed(seed)
    layer = Fp8Linear(k, n, dtype=w_dtype)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(m, k, dtype=x_dtype, requires_grad=True)
    dy = torch.randn(m, n, dtype=x_dtype)
    y = layer(x)
    y.backward(dy)
    return layer, x, dy, y


@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("m,k,n", [(3, 200, 130), (260, 256, 384)])
@pytest.mark.parametrize("executor", ["emulated", "emulated_blockwise"])
def test_fwd_dgrad_wgrad_vs_float64(m, k, n, x_dtype, w_dtype, executor, monkeypatch):
    monkeypatch.setenv("FP8RL_GEMM", executor)
    layer, x, dy, y = run_layer(m, k, n, x_dtype, w_dtype)
    xd, wd = x.detach(), layer.weight.detach()
    ulp_x = 2.0**-24 if x_dtype == torch.float32 else 2.0**-8  # bf16 unit roundoff (8-bit significand)
    ulp_w = 2.0**-24 if w_dtype == torch.float32 else 2.0**-8  # bf16 unit roundoff (8-bit significand)
    # forward: Q(X)[1,128] . Q(W)[128,128]^T + b
    a, b = deq64(xd, ACT), deq64(wd, WGT)
    y_ref = a @ b.T + layer.bias.double()
    check_close(y, y_ref, a.abs() @ b.abs().T + layer.bias.double().abs(), k, ulp_x)
    assert y.dtype == x_dtype
    # dgrad: Q(dY)[1,128] . Q(W)   (the same [128,128] weight blocks, transposed)
    g = deq64(dy, ACT)
    dx_ref = g @ b
    check_close(x.grad, dx_ref, g.abs() @ b.abs(), n, ulp_x)
    assert x.grad.dtype == x_dtype
    # wgrad: Q(dY)[128,1]^T . Q(X)[128,1]   (re-quantized along tokens from the high-precision copies)
    gc, ac = deq64(dy, COL), deq64(xd, COL)
    dw_ref = gc.T @ ac
    check_close(layer.weight.grad, dw_ref, gc.abs().T @ ac.abs(), m, ulp_w)
    assert layer.weight.grad.dtype == w_dtype
    # bias: sum over tokens in FP32
    db_ref = dy.double().sum(0)
    torch.testing.assert_close(layer.bias.grad.double(), db_ref, rtol=ulp_w + 1e-6, atol=1e-5)


def test_wgrad_uses_column_blocks_not_row_blocks():
    """Guards the recipe: quantizing the wgrad operands in [1,128] (per token) would fail the tight check."""
    layer, x, dy, _ = run_layer(256, 256, 128, torch.float32, torch.float32, seed=1)
    g_wrong, a_wrong = deq64(dy, ACT), deq64(x.detach(), ACT)
    err = (layer.weight.grad.double() - g_wrong.T @ a_wrong).abs().max()
    assert err > 1e-4


def test_close_to_bf16_linear():
    """Loose check against the unquantized layer. E4M3 rounds each operand with a relative error of at
    most 2**-4 (RMS about 2**-4/sqrt(3) ~ 0.036 for uniformly spread mantissas, smaller on average), and
    the errors of the two operands add in quadrature: the relative Frobenius error of y, dX, dW must be
    below 0.06. BF16 (8-bit mantissa) is ~2**-9, so FP8 must also be visibly worse than BF16 (> 0.003)."""
    torch.manual_seed(0)
    ref = nn.Linear(512, 256, dtype=torch.float64)
    fp8 = Fp8Linear.from_linear(nn.Linear(512, 256, dtype=torch.bfloat16))
    with torch.no_grad():
        fp8.weight.copy_(ref.weight)
        fp8.bias.copy_(ref.bias)
        ref.weight.copy_(fp8.weight)  # the same bf16-representable master weights
        ref.bias.copy_(fp8.bias)
    x = torch.randn(4, 64, 512, dtype=torch.bfloat16)
    dy = torch.randn(4, 64, 256, dtype=torch.bfloat16)
    xr = x.double().requires_grad_(True)
    x8 = x.clone().requires_grad_(True)
    ref(xr).backward(dy.double())
    y8 = fp8(x8)
    y8.backward(dy)
    y_ref = ref(xr.detach())
    for got, want in ((y8, y_ref), (x8.grad, xr.grad), (fp8.weight.grad, ref.weight.grad)):
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert 0.003 < rel < 0.06, rel


def test_fp8_linear_matches_layer_forward_bit_exact():
    for x_dtype, w_dtype in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                             (torch.float32, torch.float32)):
        torch.manual_seed(0)
        layer = Fp8Linear(300, 200, dtype=w_dtype)
        x = torch.randn(2, 7, 300, dtype=x_dtype)
        w = quantize_weight(layer.weight, layer.bias)
        y_inf = fp8_linear(x, w)
        with torch.no_grad():
            y_train = layer(x)
        assert y_inf.dtype == x_dtype and y_inf.shape == (2, 7, 200)
        assert torch.equal(y_inf, y_train)


def test_power_of_two_option_reaches_quantizer():
    torch.manual_seed(0)
    layer = Fp8Linear(256, 128, bias=False, quant=POW2)
    x = torch.randn(8, 256)
    a, b = deq64(x, ACT), deq64(layer.weight.detach(), WGT)
    qx, sx = quantize_blockwise(x, ACT, power_of_two=True)
    qw, sw = quantize_blockwise(layer.weight.detach(), WGT, power_of_two=True)
    a2 = dequantize_blockwise(qx, sx, ACT).double()
    b2 = dequantize_blockwise(qw, sw, WGT).double()
    y = layer(x).detach().double()
    y_ref = a2 @ b2.T
    check_close(y, y_ref, a2.abs() @ b2.abs().T, 256, 2.0**-24)
    assert not torch.allclose(y, a @ b.T, rtol=1e-5, atol=0)  # plain scales give a different result


def test_state_dict_round_trip_and_from_linear():
    lin = nn.Linear(64, 32)
    fp8 = Fp8Linear(64, 32)
    fp8.load_state_dict(lin.state_dict())
    assert torch.equal(fp8.weight, lin.weight) and torch.equal(fp8.bias, lin.bias)
    back = nn.Linear(64, 32, bias=True)
    back.load_state_dict(fp8.state_dict())
    assert set(fp8.state_dict()) == {"weight", "bias"}
    assert torch.equal(back.weight, lin.weight)
    shared = Fp8Linear.from_linear(lin, quant=POW2)
    assert shared.weight is lin.weight and shared.bias is lin.bias and shared.power_of_two
    nobias = Fp8Linear.from_linear(nn.Linear(8, 4, bias=False))
    assert nobias.bias is None and nobias(torch.randn(2, 8)).shape == (2, 4)
    with pytest.raises(TypeError, match="unexpected"):
        Fp8Linear.from_linear(lin, bogus=1)


def test_quantization_is_the_one_configuration():
    """The knobs come from the Quantization only: a per-knob keyword is refused, naming quant=Quantization."""
    lin = nn.Linear(64, 32)
    quant = Quantization(scale_format="pow2", check_finite=False)
    for layer in (Fp8Linear.from_linear(lin, quant=quant), Fp8Linear(64, 32, quant=quant)):
        assert layer.power_of_two and not layer.check_finite
    with pytest.raises(TypeError, match=r"\['check_finite', 'power_of_two'\].*quant=Quantization"):
        Fp8Linear.from_linear(lin, power_of_two=False, check_finite=True, quant=quant)
    with pytest.raises(TypeError):
        quantize_weight(lin.weight, power_of_two=True)
    with pytest.raises(TypeError, match="quant must be a Quantization"):
        Fp8Linear(64, 32, quant=None)
    plain = Fp8Linear.from_linear(lin, quant=Quantization())
    assert not plain.power_of_two and plain.check_finite and plain.weight is lin.weight


def test_autocast_casts_input_to_bf16():
    torch.manual_seed(0)
    layer = Fp8Linear(256, 64)
    x = torch.randn(5, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(y, layer(x.detach().bfloat16()))
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


def test_non_finite_input_raises_with_name():
    layer = Fp8Linear(128, 16)
    x = torch.randn(2, 128)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="x"):
        layer(x)
    layer.check_finite = False
    assert torch.isnan(layer(x)).any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_layer_matches_emulation(monkeypatch):
    """On a GPU, the selected hardware executor agrees with the emulation to ~1e-3 (relative norm),
    far below the FP8 quantization error (~3e-2): same quantized operands, different accumulation."""
    torch.manual_seed(0)
    layer = Fp8Linear(640, 384, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, 70, 640, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(3, 70, 384, device="cuda", dtype=torch.bfloat16)
    grads = {}
    for executor in ("emulated", None):
        if executor:
            monkeypatch.setenv("FP8RL_GEMM", executor)
        else:
            monkeypatch.delenv("FP8RL_GEMM", raising=False)
        xi = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = layer(xi)
        y.backward(dy)
        grads[executor] = (y.float(), xi.grad.float(), layer.weight.grad.float())
    for hw, em in zip(grads[None], grads["emulated"]):
        assert ((hw - em).norm() / em.norm()).item() < 2e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_direct_cpu_path_gives_the_general_paths_bits(monkeypatch, dtype):
    """Generation's direct path (one fused call, one GEMM with the kept dequantized weight) against the
    general dispatch (quantize_operand + linear_from_operands), bit for bit, and it is the one taken."""
    from fp8rl_core.fp8 import functional
    from fp8rl_core.fp8.functional import ACT_BLOCK, linear_from_operands, quantize_operand

    g = torch.Generator().manual_seed(7)
    w = quantize_weight(torch.randn(300, 256, generator=g), torch.randn(300, generator=g))
    x = torch.randn(5, 7, 256, generator=g).to(dtype)
    general = linear_from_operands(quantize_operand(x.reshape(-1, 256), ACT_BLOCK, power_of_two=False,
                                                    check_finite=False, name="x"), w, dtype).reshape(5, 7, 300)
    monkeypatch.setattr(functional, "linear_from_operands", None)  # the general path would now fail
    direct = fp8_linear(x, w)
    assert direct.dtype == dtype and torch.equal(direct, general)


# ---- fp8.quantize_from: what Q(W) quantizes ---------------------------------------------------------
def _codes(w) -> tuple[torch.Tensor, torch.Tensor]:
    """An Fp8Weight's E4M3 codes as bytes (bitwise comparable) and its scales."""
    return w.q.view(torch.uint8), w.scale


def test_quantize_dtype_bf16_quantizes_what_the_generation_engine_quantizes():
    """quantize_dtype=bf16: Q(W) is Q(bf16(W)) bit for bit, the very quantization the generation engine's
    refit does (`fuse_linear` on the BF16 copy it is sent); None: Q of the FP32 master, which differs for
    a weight whose values are not BF16-representable. Under autocast the trainer's forward then equals
    the engine's FP8 linear bit for bit."""
    from fp8rl_core.engines.native_gen import fuse_linear

    torch.manual_seed(0)
    layer = Fp8Linear(300, 256, bias=False, quantize_dtype=torch.bfloat16)  # 256 rows: no FP8 row padding
    master = Fp8Linear.from_linear(layer)  # same Parameter, quantize_dtype None (fp8.quantize_from: master)
    w = layer.weight.detach()
    assert not torch.equal(w, w.bfloat16().float())  # FP32 values that BF16 rounds
    engine = fuse_linear([w.bfloat16()], [None], Quantization())
    ours, direct = _codes(layer.quantized_weight()), _codes(quantize_weight(w.bfloat16()))
    for a, b, c in zip(ours, direct, _codes(engine.weight)):
        assert torch.equal(a, b) and torch.equal(a, c)
    q_master, s_master = _codes(master.quantized_weight())
    assert not (torch.equal(q_master, ours[0]) and torch.equal(s_master, ours[1]))
    x = torch.randn(4, 6, 300)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        y_train = layer(x)
    y_gen = engine(x.bfloat16())
    assert y_train.dtype == y_gen.dtype == torch.bfloat16 and torch.equal(y_train, y_gen)
    assert "quantize_from=bfloat16" in repr(layer) and "quantize_from=as stored" in repr(master)


def test_quantize_dtype_is_part_of_the_weight_cache_key():
    """Switching quantize_dtype on a layer re-quantizes (the cached Q(W) of the other source is not reused)."""
    torch.manual_seed(0)
    layer = Fp8Linear(256, 128, bias=False)
    as_stored = _codes(layer.quantized_weight())
    layer.quantize_dtype = torch.bfloat16
    rounded = _codes(layer.quantized_weight())
    assert all(torch.equal(a, b) for a, b in zip(rounded, _codes(quantize_weight(layer.weight.bfloat16()))))
    assert not all(torch.equal(a, b) for a, b in zip(as_stored, rounded))


@pytest.mark.parametrize("source, compute, expected", [
    ("bf16", torch.bfloat16, torch.bfloat16), ("master", torch.bfloat16, None),
    ("bf16", torch.float32, None),  # FP32 compute: the master itself is the copy generation gets
])
def test_training_engine_honours_quantize_from(source, compute, expected):
    from fp8rl_core.config import Fp8Spec
    from fp8rl_core.config.recipe import resolve_recipe
    from fp8rl_core.engines.native_train import NativeTrainingEngine
    from fp8rl_core.model import ModelConfig, build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))
    engine = NativeTrainingEngine(model, recipe=resolve_recipe("fp8_e2e", Fp8Spec(quantize_from=source)),
                                  compute_dtype=compute)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == len(engine.fp8_modules) == 14
    assert all(m.quantize_dtype == expected for m in layers)
