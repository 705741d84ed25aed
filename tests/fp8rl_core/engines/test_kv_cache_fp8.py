"""The E4M3 KV cache (engines/kv_quant.py, fp8.kv_cache e4m3): codes against an independent round-to-nearest-even
E4M3 table, the prefill and decode attention against float64 on the same codes and scales, each scale design's
formula on constructed tensors (float64 references), the trainer's K/V capture, and the engine's refusal of
stale or default scales.

Tolerances: the attention kernels run in FP32 on fl32(code * scale); the float64 reference multiplies the same
codes and scales in float64. Their difference is FP32 rounding: max|diff| <= 2e-6 * (1 + max|ref|).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from fp8rl_core.config.recipe import BF16, RECIPES
from fp8rl_core.engines import kv_quant
from fp8rl_core.engines.base import SamplingParams, TrainBatch
from fp8rl_core.engines.kv_cache import decode_attention, prefill_attention
from fp8rl_core.engines.kv_quant import KVQuantizer, KVScales, trainer_scales
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.engines.native_train import NativeTrainingEngine
from fp8rl_core.model import build_model
from fp8rl_core.model.config import ModelConfig

SMALL = dict(vocab_size=48, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)
PROMPTS = [[1, 5, 7, 9, 11], [1, 3], [1, 4, 4, 8, 15, 16, 23, 42]]
TOL = 2e-6


def _e4m3_table() -> np.ndarray:
    """Every finite non-negative E4M3 (fn) value, from its bits: (sign 0) eeee mmm, bias 7, no inf, 0x7F NaN."""
    vals = []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue
            vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


def _rne_e4m3(r: np.ndarray) -> np.ndarray:
    """Round float64 r to the nearest E4M3 value, ties to the even code (mantissa bit 0 clear), saturate at 448."""
    table = _e4m3_table()
    a = np.minimum(np.abs(r), 448.0)
    idx = np.searchsorted(table, a)
    hi_i = np.clip(idx, 0, len(table) - 1)
    lo, hi = table[np.clip(idx - 1, 0, len(table) - 1)], table[hi_i]
    pick_hi = (hi - a < a - lo) | ((hi - a == a - lo) & (hi_i % 2 == 0))
    return np.sign(r) * np.where(pick_hi, hi, lo)


def _codes_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    r = (x.float() / scale).double().numpy()  # the FP32 division, as the kernel divides
    return torch.from_numpy(_rne_e4m3(r))


def test_codes_are_round_to_nearest_even_and_saturate():
    torch.manual_seed(0)
    x = torch.randn(4, 2, 64, 16) * 3
    x[0, 0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 448.0 * 0.02])  # saturation, zero, exact top code
    scale = torch.tensor(0.02)
    codes = kv_quant.e4m3_codes(x.float(), scale)
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(codes.double(), _codes_ref(x, scale))
    assert codes.float()[0, 0, 0, :4].tolist() == [448.0, -448.0, 0.0, 448.0]


def test_kv_quantize_from_bf16_rounds_first_and_equals_compute_under_bf16():
    torch.manual_seed(1)
    x = torch.randn(3, 2, 5, 8)
    s = torch.tensor(0.01)
    assert torch.equal(kv_quant.fake_quant(x, s, "bf16"), kv_quant.fake_quant(x.bfloat16().float(), s, "compute"))
    xb = x.bfloat16()
    assert torch.equal(kv_quant.fake_quant(xb, s, "bf16"), kv_quant.fake_quant(xb, s, "compute"))


def _attend64(q, k, v, causal: bool, bias=None):
    """float64 softmax(q k^T / sqrt(D)) v with GQA (q [B, Hq, T, D], k/v [B, Hkv, S, D])."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        t = q.shape[2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    if bias is not None:
        s = s + bias.double()
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("mode", ["trainer", "per_token_head"])
def test_prefill_and_decode_attention_equal_float64_on_the_same_codes(mode):
    torch.manual_seed(2)
    b, hq, hkv, t, d = 3, 4, 2, 7, 16
    q, k, v = torch.randn(b, hq, t, d), torch.randn(b, hkv, t, d) * 2, torch.randn(b, hkv, t, d)
    quant = KVQuantizer(mode, "compute", 1)
    quant.refit(0, KVScales(torch.tensor([0.011]), torch.tensor([0.007]), 0))
    kd, vd = quant.apply(0, k, v)
    if mode == "per_token_head":
        ks, vs = kv_quant.per_token_head_scale(k), kv_quant.per_token_head_scale(v)
    else:
        ks, vs = torch.tensor(0.011), torch.tensor(0.007)
    k64, v64 = _codes_ref(k, ks) * ks.double(), _codes_ref(v, vs) * vs.double()
    assert (kd.double() - k64).abs().max() <= 1e-7 * k64.abs().max()  # fl32(code * s): one FP32 rounding
    ref = _attend64(q.double(), k64, v64, causal=True)
    out = prefill_attention(q, kd, vd).view(b, t, hq, d).transpose(1, 2)
    assert (out.double() - ref).abs().max() <= TOL * (1 + ref.abs().max())
    # decode: the last query against the whole cache, one slot masked as padding
    bias = torch.zeros(b, 1, 1, t)
    bias[0, ..., 0] = float("-inf")
    ref_d = _attend64(q[:, :, -1:].double(), k64, v64, causal=False, bias=bias)[:, :, 0]
    out_d = decode_attention(q[:, :, -1], kd, vd, bias).view(b, hq, d)
    assert (out_d.double() - ref_d).abs().max() <= TOL * (1 + ref_d.abs().max())


def test_per_token_head_scale_is_amax_over_d_over_448():
    x = torch.zeros(1, 2, 3, 4)
    x[0, 0, 0] = torch.tensor([1.0, -8.96, 2.0, 0.5])
    x[0, 1, 2] = torch.tensor([0.25, 0.0, 0.0, 0.0])
    s = kv_quant.per_token_head_scale(x)[..., 0]
    expect = torch.ones(1, 2, 3)
    expect[0, 0, 0], expect[0, 1, 2] = 8.96 / 448, 0.25 / 448
    assert torch.equal(s, expect.float())  # all-zero (row, head, slot): 1.0


def test_trainer_scales_formula_float64():
    torch.manual_seed(3)
    k_amax, v_amax = torch.rand(7, 3) * 10, torch.rand(7, 3) * 4
    s = trainer_scales(k_amax, v_amax, step=5)
    for got, amax in ((s.k, k_amax), (s.v, v_amax)):
        ref = np.percentile(amax.double().numpy(), 99.9, axis=0) * 1.05 / 448  # numpy's linear interpolation
        assert np.allclose(got.double().numpy(), ref, rtol=1e-7, atol=0)
    one = trainer_scales(k_amax[:1], v_amax[:1], step=1)  # one forward: that forward's amax
    assert torch.allclose(one.k.double(), k_amax[0].double() * 1.05 / 448, rtol=1e-7)
    assert s.step == 5 and float(s.checksum()) == kv_quant.checksum(s.k, s.v) < 2**24


def test_first_forward_scales_come_from_the_first_forward_and_stay():
    quant = KVQuantizer("first_forward", "compute", 2)
    quant.refit(3, None)
    k1, v1 = torch.full((1, 1, 2, 4), 2.0), torch.full((1, 1, 2, 4), -3.0)
    for layer in range(2):
        quant.apply(layer, k1 * (layer + 1), v1)
    quant.end_prefill()
    quant.apply(0, k1 * 100, v1 * 100)  # a later forward does not move them
    assert quant.scales.step == 3
    assert torch.equal(quant.scales.k, torch.tensor([2.0 / 200, 4.0 / 200]))
    assert torch.equal(quant.scales.v, torch.tensor([3.0 / 100, 3.0 / 100]))
    quant.refit(4, None)  # a refit recomputes them at the next forward
    assert quant.pending and quant.scales is None


# ---- the trainer's capture --------------------------------------------------------------------------------------

def _cfg() -> ModelConfig:
    return ModelConfig(**SMALL)


def test_trainer_kv_scales_capture_post_rope_k_and_v_of_real_tokens_only():
    torch.manual_seed(4)
    cfg = _cfg()
    model = build_model(cfg)
    train = NativeTrainingEngine(model, compute_dtype=torch.float32, micro_batch_size=2)
    ids = torch.randint(0, 48, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False
    ids[1, 4:] = 47  # padding
    batch = TrainBatch(ids, mask, torch.zeros_like(mask))
    before = train.logprobs(dataclasses.replace(batch, response_mask=mask))
    scales = train.kv_scales(batch, step=9)
    assert torch.equal(train.logprobs(dataclasses.replace(batch, response_mask=mask)), before)  # reads only
    # layer 0 by hand: k = RoPE(k_proj(norm(embed(ids)))), v = v_proj(norm(embed(ids)))
    from fp8rl_core.model.layers import apply_rope, rope_cos_sin
    attn, norm = model.model.layers[0].self_attn, model.model.layers[0].input_layernorm
    with torch.no_grad():
        h = norm(model.model.embed_tokens(ids))
        k = attn.k_proj(h).view(3, 6, 2, -1).transpose(1, 2)
        v = attn.v_proj(h).view(3, 6, 2, -1).transpose(1, 2)
        cos, sin = rope_cos_sin(torch.arange(6).expand(3, 6), cfg.head_dim, cfg.rope_theta, k.dtype)
        k = apply_rope(k, cos, sin)
    real = mask[:, None, :, None]
    amax = lambda x, rows: x[rows].abs().masked_fill(~real[rows], 0).amax().double()  # noqa: E731
    per_fwd_k = torch.stack([amax(k, slice(0, 2)), amax(k, slice(2, 3))])  # micro-batches of 2 rows
    per_fwd_v = torch.stack([amax(v, slice(0, 2)), amax(v, slice(2, 3))])
    ref_k = torch.quantile(per_fwd_k, 0.999) * 1.05 / 448
    ref_v = torch.quantile(per_fwd_v, 0.999) * 1.05 / 448
    assert scales.step == 9
    assert math.isclose(float(scales.k[0]), float(ref_k), rel_tol=1e-6)
    assert math.isclose(float(scales.v[0]), float(ref_v), rel_tol=1e-6)
    assert all(a.kv_observer is None for a in (layer.self_attn for layer in model.model.layers))


# ---- the engine -------------------------------------------------------------------------------------------------

def _engine(kv_scale: str, model=None, **kw) -> tuple[NativeGenerationEngine, torch.nn.Module]:
    torch.manual_seed(5)
    cfg = _cfg()
    model = model or build_model(cfg)
    recipe = dataclasses.replace(BF16, kv_cache="e4m3", kv_scale=kv_scale, **kw)
    return NativeGenerationEngine(cfg, recipe=recipe, dtype=torch.float32), model


def _trainer_scales(model, step: int) -> KVScales:
    train = NativeTrainingEngine(model, compute_dtype=torch.float32)
    ids = torch.tensor([p + [0] * (8 - len(p)) for p in PROMPTS])
    mask = ids != 0
    return train.kv_scales(TrainBatch(ids, mask, torch.zeros_like(mask)), step)


SAMPLING = SamplingParams(max_new_tokens=4, seed=0)


def test_engine_refuses_missing_stale_and_default_scales():
    gen, model = _engine("trainer")
    weights = model.state_dict()
    gen.refit(weights, step=0)  # no scales: NeMo RL #3226's silent default
    with pytest.raises(RuntimeError, match="brought no KV scales"):
        gen.generate(PROMPTS, SAMPLING)
    good = _trainer_scales(model, 0)
    gen.refit(weights, step=0, kv_scales=good)
    out = gen.generate(PROMPTS, SAMPLING)
    assert gen.kv_scales_in_use() == (0.0, good.checksum())
    gen.refit(weights, step=1, kv_scales=good)  # weights of step 1, scales of step 0: stale
    with pytest.raises(RuntimeError, match="stale KV scales, computed with the weights of step 0.*step 1"):
        gen.generate(PROMPTS, SAMPLING)
    ones = dataclasses.replace(good, k=torch.ones_like(good.k), step=1, amax_k=good.amax_k * 0 + 1e-3)
    gen.refit(weights, step=1, kv_scales=ones)
    with pytest.raises(RuntimeError, match="exactly 1.0.*default scale"):
        gen.generate(PROMPTS, SAMPLING)
    assert out.logprobs.isfinite().all()


def test_prefill_attends_over_the_stored_values(monkeypatch):
    """e4m3: prefill's logits move with what the quantizer returns; with an identity quantizer they equal the
    cache in the dtype (FP32 here) to FP32 rounding, so prefill reads the dequantized values, not k/v."""
    gen, model = _engine("per_token_head")
    gen.refit(model.state_dict(), step=0)
    plain = NativeGenerationEngine(_cfg(), recipe=BF16, dtype=torch.float32)
    plain.refit(model.state_dict())
    ids = torch.tensor([PROMPTS[2]])
    quantized, reference = gen.logits(ids), plain.logits(ids)
    assert not torch.equal(quantized, reference)
    monkeypatch.setattr(KVQuantizer, "apply", lambda self, layer, k, v: (k.float(), v.float()))
    same = gen.logits(ids)
    assert (same - reference).abs().max() <= 1e-5 * reference.abs().max()


def test_kv_cache_auto_is_the_dtype_cache_bit_for_bit():
    torch.manual_seed(6)
    cfg, model = _cfg(), build_model(_cfg())
    outs = []
    for recipe in (RECIPES["bf16"], dataclasses.replace(RECIPES["bf16"], kv_scale="trainer", kv_cache="auto")):
        gen = NativeGenerationEngine(cfg, recipe=recipe, dtype=torch.bfloat16)
        gen.refit(model.state_dict())
        assert gen.kv is None and gen.kv_scales_in_use() is None
        outs.append(gen.generate(PROMPTS, SAMPLING))
    assert torch.equal(outs[0].logprobs, outs[1].logprobs) and torch.equal(outs[0].response_ids, outs[1].response_ids)


@pytest.mark.slow
@pytest.mark.parametrize("kv_scale", ["first_forward", "per_token_head"])
def test_engine_designs_without_trainer_scales_generate_and_report_their_step(kv_scale):
    gen, model = _engine(kv_scale)
    gen.refit(model.state_dict(), step=7)
    out = gen.generate(PROMPTS, SAMPLING)
    step, total = gen.kv_scales_in_use()
    assert step == 7.0 and 0 <= total < 2**24 and out.logprobs.isfinite().all()
    again = gen.generate(PROMPTS, SAMPLING)
    assert torch.equal(again.logprobs, out.logprobs)  # the same scales (first_forward: kept) and sampling seed
    assert kv_quant.kv_cache_bytes(2, 3, 2, 10, 32, kv_scale=kv_scale) == \
        2 * 2 * 3 * 2 * 10 * 32 + 4 * (2 * 2 * (3 * 2 * 10 if kv_scale == "per_token_head" else 1))


def test_a_scale_of_one_is_refused_only_far_from_its_amax():
    one = torch.ones(2)
    kv_quant.check_not_default(KVScales(one, one, 0, torch.tensor([448.0, 448.0 * 60]), torch.tensor([10.0, 448.0])))
    kv_quant.check_not_default(KVScales(one * 0.5, one, 0, torch.tensor([1e-3, 1.0]), torch.tensor([448.0, 9.0])))
    with pytest.raises(RuntimeError, match="the V scale of layer 1 is exactly 1.0"):
        kv_quant.check_not_default(KVScales(one * 0.5, one, 0, torch.tensor([1.0, 1.0]), torch.tensor([448.0, 6.0])))
    with pytest.raises(RuntimeError, match="the K scale of layer 0"):
        kv_quant.check_not_default(KVScales(one, one, 0, torch.tensor([448.0 * 65, 448.0]), torch.tensor([448.0] * 2)))


def test_trainer_scales_take_the_max_over_ranks():
    """Each rank's percentile scale, then the element-wise max (Mesh.all_reduce_max), here of two simulated ranks."""
    torch.manual_seed(7)
    a_k, a_v, b_k, b_v = torch.rand(3, 2), torch.rand(3, 2), torch.rand(5, 2) * 2, torch.rand(5, 2) / 2
    other = trainer_scales(b_k, b_v, step=2)
    other_flat = torch.cat([other.k, other.v, other.amax_k, other.amax_v]).double()

    class TwoRanks:
        distributed = True

        def all_reduce_max(self, values):
            return torch.maximum(torch.as_tensor(values, dtype=torch.float64), other_flat)

    got, mine = trainer_scales(a_k, a_v, step=2, mesh=TwoRanks()), trainer_scales(a_k, a_v, step=2)
    assert torch.equal(got.k, torch.maximum(mine.k, other.k)) and torch.equal(got.v, torch.maximum(mine.v, other.v))
