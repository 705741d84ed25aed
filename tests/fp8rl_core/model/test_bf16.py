"""BF16 matrix products, native and emulated (fp8rl_core/model/bf16.py), against float64 references.

What a BF16 GEMM with FP32 accumulation computes is C = bf16(sum_k a_k b_k): every product exact, the
sum in FP32, one rounding to BF16. The reference is that sum in float64 on the same BF16 operands. With
u = 2**-8 (BF16's unit roundoff: 8 significant bits) the bound every element of a result must meet is

    |got - ref| <= u * |ref| + (K + 4) * 2**-24 * (|A| @ |B|)        ("a few BF16 ulps")

one rounding of the result plus the FP32 summation error of K terms (test_gemm.py's accumulation
bound). SDPA adds the softmax: its reference is softmax(q k^T / sqrt(D)) v in float64 and |A| @ |B| is
P @ |V|. Torch's native BF16 CPU flash-attention kernel rounds P to BF16 before P @ V (as some GPU
kernels do; bf16.sdpa's docstring), which adds u * (P @ |V|) to its bound.

Native tests need BF16 dot-product instructions (`has_bf16_dot`); without them they skip, naming the
missing flags: torch's BF16 kernels then convert every element and are an order of magnitude slower.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp8rl_core.model import bf16

U = 2.0**-8  # BF16 unit roundoff
U32 = 2.0**-24  # FP32 unit roundoff

needs_bf16_dot = pytest.mark.skipif(not bf16.has_bf16_dot(), reason=bf16.missing_bf16_dot())


def rnd(*shape: int, seed: int) -> torch.Tensor:
    """Standard-normal values rounded to BF16 (the operands of a BF16 product)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def check_bound(got: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, k: int, extra: float = 0.0) -> None:
    """|got - ref| <= u |ref| + (k + 4) 2**-24 mag + extra * mag, elementwise (see the module docstring)."""
    tol = U * ref.abs() + (k + 4) * U32 * mag + extra * mag
    err = (got.double() - ref).abs()
    assert torch.all(err <= tol), f"max err/tol {(err / tol).max().item():.3g}"


def linear_case(bias: bool, k: int, seed: int = 0):
    x, w = rnd(3, 37, k, seed=seed), rnd(53, k, seed=seed + 1)
    b = rnd(53, seed=seed + 2) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0.0)
    mag = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0.0)
    return x, w, b, ref, mag


def sdpa_case(t: int = 33, seed: int = 0):
    q, k, v = (rnd(2, 4, t, 64, seed=seed + i) for i in range(3))
    scores = (q.double() @ k.double().transpose(-1, -2)) / 8.0
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return q, k, v, p @ v.double(), p @ v.double().abs()


def assert_not_fp32_precision(got: torch.Tensor, fp32: torch.Tensor) -> None:
    """A BF16 result of an FP32 computation: not the FP32 values (for all but the rare element that is
    BF16-representable already), and within BF16 rounding of them."""
    got, fp32 = got.detach(), fp32.detach()
    assert got.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert (got.float() != fp32).float().mean() > 0.9
    assert float(((got.double() - fp32.double()).abs() / fp32.double().abs().clamp_min(1e-30)).median()) > 1e-4


# ---- emulated: equals the float64 sum rounded once ------------------------------------------------
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("k", [64, 1000])
def test_emulated_linear_is_the_rounded_float64_product(bias, k):
    x, w, b, ref, mag = linear_case(bias, k)
    y = bf16.linear(x, w, b, emulate=True)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 37, 53)
    check_bound(y, ref, mag, k)
    # one rounding of an FP32 sum: the correctly rounded BF16 value except where the FP32 sum lies
    # within its own error of a BF16 rounding boundary (none in these draws; a handful allowed)
    assert (y.double() == ref.bfloat16().double()).float().mean() >= 0.99
    assert_not_fp32_precision(y, F.linear(x.float(), w.float(), None if b is None else b.float()))


def test_emulated_bmm_is_the_rounded_float64_product():
    a, c = rnd(6, 5, 64, seed=3), rnd(6, 64, 40, seed=4)
    y = bf16.bmm(a, c, emulate=True)
    assert y.dtype == torch.bfloat16
    check_bound(y, a.double() @ c.double(), a.double().abs() @ c.double().abs(), 64)
    assert_not_fp32_precision(y, torch.bmm(a.float(), c.float()))


def test_emulated_causal_sdpa_is_the_rounded_float64_attention():
    q, k, v, ref, mag = sdpa_case()
    y = bf16.sdpa(q, k, v, emulate=True, is_causal=True)
    assert y.dtype == torch.bfloat16 and y.shape == q.shape
    check_bound(y, ref, mag, 64)
    f32 = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    body = slice(1, None)  # query 0 attends to key 0 only: its output is v[0] itself, BF16 already
    assert_not_fp32_precision(y[..., body, :], f32[..., body, :])


def test_fp32_operands_pass_through_unchanged():
    """emulate only touches BF16 products: FP32 operands give exactly torch's own op."""
    x, w, b = torch.randn(4, 7, 32), torch.randn(9, 32), torch.randn(9)
    assert torch.equal(bf16.linear(x, w, b, emulate=True), F.linear(x, w, b))
    assert torch.equal(bf16.linear(x, w, emulate=True), F.linear(x, w))
    a, c = torch.randn(3, 4, 32), torch.randn(3, 32, 5)
    assert torch.equal(bf16.bmm(a, c, emulate=True), torch.bmm(a, c))
    q, k, v = torch.randn(3, 1, 2, 6, 16).unbind(0)
    assert torch.equal(bf16.sdpa(q, k, v, emulate=True, is_causal=True),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True))


# ---- EmulatedBf16Linear under autocast, FP32 master weights: forward and backward -----------------
def _autocast_pass(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(dy)
    return y, x.grad, layer.weight.grad, layer.bias.grad


def _master_layer(k: int = 200, n: int = 48) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(k, n)
    with torch.no_grad():
        layer.bias.normal_()
    return layer


def test_emulated_linear_module_forward_and_grads_under_autocast():
    """Forward y = bf16(x_b W_b^T + b_b) (x_b, W_b, b_b: the BF16 roundings autocast hands a BF16
    kernel); dgrad bf16(dY W_b), wgrad bf16(dY^T x_b), bias grad bf16(sum_tokens dY), each within the
    module bound against float64, returned in the parameters' / input's dtype (FP32)."""
    k, m = 200, 37
    layer = _master_layer(k)
    emu = bf16.EmulatedBf16Linear.from_linear(layer)
    x, dy = torch.randn(m, k), rnd(m, 48, seed=9)
    y, dx, dw, db = _autocast_pass(emu, x, dy)
    xb, wb, bb = (t.detach().bfloat16().double() for t in (x, layer.weight, layer.bias))
    dy64 = dy.double()
    assert y.dtype == torch.bfloat16 and dx.dtype == dw.dtype == db.dtype == torch.float32
    check_bound(y, xb @ wb.T + bb, xb.abs() @ wb.abs().T + bb.abs(), k)
    check_bound(dx, dy64 @ wb, dy64.abs() @ wb.abs(), 48)
    check_bound(dw, dy64.T @ xb, dy64.abs().T @ xb.abs(), m)
    check_bound(db, dy64.sum(0), dy64.abs().sum(0), m)
    for g in (dx, dw, db):  # BF16 gradients handed back in FP32
        assert torch.equal(g, g.bfloat16().float())
    assert_not_fp32_precision(y, F.linear(x, layer.weight, layer.bias))


def test_emulated_linear_module_shares_parameters_and_is_plain_in_fp32():
    layer = _master_layer()
    emu = bf16.EmulatedBf16Linear.from_linear(layer)
    assert emu.weight is layer.weight and emu.bias is layer.bias
    assert list(emu.state_dict()) == list(layer.state_dict()) == ["weight", "bias"]
    x = torch.randn(5, 200)
    assert torch.equal(emu(x), layer(x))  # no autocast, FP32 parameters: F.linear exactly


def test_upcast_bf16_matmuls_swaps_plain_linears_and_flags_attention():
    from fp8rl_core.fp8 import Fp8Linear
    from fp8rl_core.model import ModelConfig, build_model
    from fp8rl_core.model.layers import Attention

    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))
    keep = Fp8Linear.from_linear(model.model.layers[1].mlp.down_proj)
    model.model.layers[1].mlp.down_proj = keep
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    swapped = bf16.upcast_bf16_matmuls(model)
    assert "lm_head" in swapped and "model.layers.1.mlp.down_proj" not in swapped and len(swapped) == 1 + 2 * 7 - 1
    assert model.model.layers[1].mlp.down_proj is keep  # subclasses keep their own GEMMs
    assert all(type(m) is bf16.EmulatedBf16Linear for n, m in model.named_modules() if n in swapped)
    assert all(m.upcast_bf16 for m in model.modules() if isinstance(m, Attention))
    after = model.state_dict()
    assert list(after) == list(before) and all(after[k].data_ptr() == ptr for k, ptr in before.items())
    assert bf16.upcast_bf16_matmuls(model) == []  # idempotent


# ---- native: agrees with emulated (summation order only) -------------------------------------------
@needs_bf16_dot
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_native_linear_agrees_with_emulated(bias):
    k = 1000
    x, w, b, ref, mag = linear_case(bias, k, seed=5)
    native, emulated = bf16.linear(x, w, b), bf16.linear(x, w, b, emulate=True)
    assert native.dtype == torch.bfloat16
    check_bound(native, ref, mag, k)
    check_bound(native, emulated.double(), mag, 2 * k, extra=U)  # both within the bound of ref: 2 bounds apart
    assert_not_fp32_precision(native, F.linear(x.float(), w.float(), None if b is None else b.float()))


@needs_bf16_dot
def test_native_bmm_agrees_with_emulated():
    a, c = rnd(6, 5, 64, seed=6), rnd(6, 64, 40, seed=7)
    mag = a.double().abs() @ c.double().abs()
    native = bf16.bmm(a, c)
    check_bound(native, a.double() @ c.double(), mag, 64)
    check_bound(native, bf16.bmm(a, c, emulate=True).double(), mag, 128, extra=U)


@needs_bf16_dot
def test_native_causal_sdpa_agrees_with_emulated():
    """Native BF16 SDPA rounds P to BF16 before P @ V: one more u * (P @ |V|) in its bound."""
    q, k, v, ref, mag = sdpa_case(t=65, seed=8)
    native = bf16.sdpa(q, k, v, is_causal=True)
    assert native.dtype == torch.bfloat16
    check_bound(native, ref, mag, 64, extra=U)
    check_bound(native, bf16.sdpa(q, k, v, emulate=True, is_causal=True).double(), mag, 128, extra=2 * U)


@needs_bf16_dot
def test_native_linear_module_grads_agree_with_emulated_under_autocast():
    layer, twin = _master_layer(), _master_layer()
    x, dy = torch.randn(37, 200), rnd(37, 48, seed=9)
    native = _autocast_pass(layer, x, dy)  # plain nn.Linear: autocast's BF16 kernels
    emulated = _autocast_pass(bf16.EmulatedBf16Linear.from_linear(twin), x, dy)
    xb, wb, dy64 = x.bfloat16().double(), layer.weight.bfloat16().double(), dy.double()
    mags = (xb.abs() @ wb.abs().T + layer.bias.bfloat16().double().abs(), dy64.abs() @ wb.abs(),
            dy64.abs().T @ xb.abs(), dy64.abs().sum(0))
    for got, want, mag, k in zip(native, emulated, mags, (200, 48, 37, 37)):
        assert got.dtype == want.dtype
        check_bound(got, want.double(), mag, 2 * k, extra=U)


# ---- which path runs --------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, device, path", [
    ({"avx2", "avx512f", "avx512_bf16"}, "cpu", "native"),
    ({"avx2", "amx_tile", "amx_bf16"}, "cpu", "native"),
    ({"fp", "asimd", "bf16"}, "cpu", "native"),  # aarch64's BF16 extension
    ({"avx2", "avx512f"}, "cpu", "emulated"),
    (set(), "cpu", "emulated"),  # /proc/cpuinfo unreadable
    ({"avx2"}, "cuda", "native"),  # GPUs: tensor cores
    ({"avx2"}, torch.device("cuda", 1), "native"),
])
def test_auto_resolves_by_cpu_flags_and_device(flags, device, path):
    assert bf16.resolve_bf16_compute("auto", device, frozenset(flags)) == path
    if torch.device(device).type == "cpu":
        assert bf16.has_bf16_dot(frozenset(flags)) == (path == "native")


@pytest.mark.parametrize("mode", ["native", "emulated"])
def test_explicit_modes_are_taken_as_given(mode):
    for flags in (frozenset(), frozenset({"amx_bf16"})):
        assert bf16.resolve_bf16_compute(mode, "cpu", flags) == mode


def test_bad_mode_names_the_key_and_the_valid_values():
    with pytest.raises(ValueError) as e:
        bf16.resolve_bf16_compute("fast", "cpu")
    assert "model.bf16_compute" in str(e.value) and "'fast'" in str(e.value)
    assert "auto, native, emulated" in str(e.value)


def test_bf16_path_is_none_for_fp32_models(monkeypatch):
    monkeypatch.setattr(bf16, "cpu_flags", lambda: frozenset({"avx2"}))
    assert bf16.bf16_path("fp32", "emulated", "cpu") == "none"
    assert bf16.bf16_path("fp32", "auto", "cpu") == "none"
    assert bf16.bf16_path("bf16", "auto", "cpu") == "emulated"
    assert bf16.bf16_path("bf16", "native", "cpu") == "native"
    monkeypatch.setattr(bf16, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert bf16.bf16_path("bf16", "auto", "cpu") == "native"


def test_recorded_flags_in_fixed_order(monkeypatch):
    monkeypatch.setattr(bf16, "cpu_flags", lambda: frozenset({"sse2", "amx_bf16", "avx2", "avx512_bf16"}))
    assert bf16.recorded_flags() == "avx2,avx512_bf16,amx_bf16"
    monkeypatch.setattr(bf16, "cpu_flags", lambda: frozenset({"sse2"}))
    assert bf16.recorded_flags() == ""


def test_cpu_flags_reads_proc_cpuinfo():
    flags = bf16.cpu_flags()
    assert isinstance(flags, frozenset)
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert flags == frozenset()
        return
    line = next((ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("flags", "Features")), None)
    assert flags == (frozenset(line.split(":", 1)[1].split()) if line else frozenset())
