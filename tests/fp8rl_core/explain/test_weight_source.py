"""The replay's FP8 variants quantize the weights the run's engines quantize (issue 29).

Under `fp8.quantize_from: bf16` (the default) both engines quantize the BF16 rounding of the FP32 master
(fp8rl_core/model/fp8_policy.py `quantize_source`). The replay's `weights` and `both` variants quantized
the FP32 master instead, so they replayed other weights than the run: on the episode's checkpoint 65
every [128, 128] block of layer 0's q/k projections had another scale and 193–511 of its 16,384 E4M3
codes differed, and `both` read 1.46 where the run's own trainer reads 8.63 against BF16. The data file
is one such block, cut from the evidence's checkpoint (shared/evidence/fp8_e2e_instability, cell
d21979f725f3, `model.layers.0.self_attn.k_proj.weight[:128, :128]`, FP32).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fp8rl_core.config import load_run_config, recipe_of
from fp8rl_core.explain.attribution import TrainKernels, fake_quantize
from fp8rl_core.explain.replay import _as_run_trainer, build_variants
from fp8rl_core.fp8 import Fp8Linear, quantize_blockwise
from fp8rl_core.fp8.gemm import pin_executor
from fp8rl_core.model import build_model, preset
from fp8rl_core.model.fp8_policy import quantize_source

BLOCK = Path(__file__).parent / "data" / "episode_step65_layer0_k_proj_block.safetensors"
BF16_ULP = 2.0 ** -8  # relative spacing of BF16 at the top of a binade: the outputs' rounding


@pytest.fixture
def emulated():
    """The FP32 emulation on both sides: the fake quantization's GEMM is an FP32 product of the same
    dequantized values, so only summation order may differ (bounded below by one BF16 rounding)."""
    pin_executor("emulated")
    yield
    pin_executor(None)


def _linear(weight: torch.Tensor) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


def test_the_episode_block_quantizes_differently_from_its_master():
    """Why the source matters: on the cut block, Q(master) and Q(BF16 rounding) differ in scale and codes."""
    w = load_file(BLOCK)["weight"]
    q32, s32 = quantize_blockwise(w, (128, 128))
    q16, s16 = quantize_blockwise(w.to(torch.bfloat16).float(), (128, 128))
    assert not torch.equal(s32, s16)
    assert int((q32.float() != q16.float()).sum()) > 0


def test_fake_quantization_replays_the_trainers_fp8_linear(emulated):
    """The replay's W+A fake quantization of the cut block equals the trainer's Fp8Linear (quantize_dtype
    from the run's recipe) within one BF16 rounding per output; the master-sourced one (today's bug) does not."""
    w = load_file(BLOCK)["weight"]
    source = quantize_source(recipe_of(load_run_config(None, ["recipe=fp8_e2e"])).training, torch.bfloat16)
    assert source == torch.bfloat16
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    real = Fp8Linear.from_linear(_linear(w), quantize_dtype=source)
    replayed, master = nn.Sequential(_linear(w)), nn.Sequential(_linear(w))
    fake_quantize(replayed, (), True, True, quantize_dtype=source)
    fake_quantize(master, (), True, True, quantize_dtype=None)
    with torch.no_grad():
        want, got, old = real(x).float(), replayed(x).float(), master(x).float()
    tol = BF16_ULP * want.abs() + 1e-30
    assert ((got - want).abs() <= tol).all()
    assert ((old - want).abs() > tol).any()


def test_the_both_variant_is_the_runs_fp8_trainer(emulated):
    """`explain`'s `both` side scores a batch as the run's FP8 trainer does (fp8_e2e, BF16 compute)."""
    torch.manual_seed(0)
    cfg = load_run_config(None, ["recipe=fp8_e2e"])
    mc = preset("tiny")
    model = build_model(mc)
    weights = dict(model.state_dict())
    [(_, _, both)] = list(build_variants(["both"], weights, cfg, mc))
    trainer = _as_run_trainer(model, recipe_of(cfg), cfg.rollout.temperature, torch.bfloat16)
    assert isinstance(both, TrainKernels)
    ids = torch.randint(3, mc.vocab_size, (12,), generator=torch.Generator().manual_seed(1))
    lp_both, lp_run = both.score(ids)[0], trainer.score(ids)[0]
    # log-softmax of BF16 logits: one BF16 rounding of a logit moves a log-prob by at most ~ulp * |logit|
    assert torch.allclose(lp_both, lp_run, rtol=0, atol=1e-2)
    assert float((lp_both - lp_run).abs().max()) <= float(
        (TrainKernels(model, "bf16", temperature=cfg.rollout.temperature).score(ids)[0] - lp_run).abs().max())
