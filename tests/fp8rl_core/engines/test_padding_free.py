"""train.padding_free: the training engine's passes on the real tokens only (fp8rl_core/model/packing.py).

Against the padded path on the same weights and batch: the same log-probs, loss and gradients in FP32 and
BF16 (within the roundings a different GEMM row count may change); in fp8_e2e the same forward and the
same activation gradients, and weight gradients that differ only where packing changes which tokens share
an FP8 wgrad block, within the E4M3 bound derived below. Then the run-config key (cell id, errors) and a
tiny end-to-end run with it.
"""
from __future__ import annotations

import json

import pytest
import torch

from fp8rl_core.config import OptimSpec, load_run_config
from fp8rl_core.config.recipe import RECIPES
from fp8rl_core.config.run_config import hashed_dict, run_config_hash
from fp8rl_core.config.schema import ConfigError
from fp8rl_core.engines import native_train
from fp8rl_core.engines.base import TrainBatch
from fp8rl_core.engines.native_train import NativeTrainingEngine, ReferencePolicy
from fp8rl_core.fp8 import Fp8Linear, quantize_blockwise
from fp8rl_core.model import ModelConfig, build_model
from fp8rl_core.model.bf16 import has_bf16_dot, missing_bf16_dot

CFG = ModelConfig(vocab_size=32, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
B, T, PROMPT = 16, 20, 4  # 16 sequences of 6..20 tokens: ~200 real of 320 padded, so several [128, 1] blocks
COL = (128, 1)


def make_batch(seed: int = 3) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(PROMPT + 2, T + 1, (B,), generator=g)
    lengths[0] = T
    pos = torch.arange(T)
    attn = pos[None] < lengths[:, None]
    resp = attn & (pos[None] >= PROMPT)
    ids = torch.where(attn, torch.randint(3, CFG.vocab_size, (B, T), generator=g), 0)
    adv = torch.randn(B, generator=g)[:, None] * resp
    return TrainBatch(ids, attn, resp, advantages=adv.contiguous())


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(CFG)


def step(recipe: str, dtype: torch.dtype, padding_free: bool, emulate: bool, batch: TrainBatch, capture=False):
    """One train_step; returns (engine, its TrainResult, {param: grad}, {fp8 layer: (X, dY)} of the step's forward)."""
    model = make_model()
    engine = NativeTrainingEngine(model, recipe=RECIPES[recipe], compute_dtype=dtype, optim=OptimSpec(grad_clip=0.0),
                                  upcast_bf16=emulate, padding_free=padding_free)
    grads, acts = {}, {}
    engine.optimizer.step = lambda: grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
    if capture:
        for name, mod in model.named_modules():
            if isinstance(mod, Fp8Linear):
                mod.register_forward_pre_hook(_keep_input(acts, name))
                mod.register_full_backward_hook(_keep_grad(acts, name))
    result = engine.train_step(batch)
    return engine, result, grads, acts


def _keep_input(acts, name):
    def hook(mod, args):
        x = args[0]
        if torch.is_autocast_enabled(x.device.type):  # what Fp8Linear quantizes: the autocast dtype's copy
            x = x.to(torch.get_autocast_dtype(x.device.type))
        acts[name] = [x.detach().reshape(-1, x.shape[-1])]
    return hook


def _keep_grad(acts, name):
    def hook(mod, grad_in, grad_out):
        acts[name].append(grad_out[0].detach().reshape(-1, grad_out[0].shape[-1]))
    return hook


NATIVE = pytest.mark.skipif(not has_bf16_dot(), reason=missing_bf16_dot() or "-")
PATHS = [pytest.param(torch.float32, False, id="fp32"), pytest.param(torch.bfloat16, True, id="bf16-emulated"),
         pytest.param(torch.bfloat16, False, id="bf16-native", marks=NATIVE)]


@pytest.mark.parametrize("dtype,emulate", PATHS)
def test_logprobs_loss_and_every_gradient_equal_the_padded_path(dtype, emulate):
    """Tolerances. Per token the padding-free forward runs the same operations (row-wise GEMMs, norms, the
    same attention over the same keys), so log-probs may differ only where a GEMM's summation order depends
    on its row count: |diff| <= 1e-5 in FP32 and 2**-8 in BF16 (one flipped BF16 rounding of an activation
    of size <= 1). The loss is a sum over the same per-token terms: relative 1e-6. Gradients: wgrad, the norm
    weights and the embedding sum over tokens (N real rows vs B*T padded rows, whose padding rows carry
    zero gradient), so only their FP32 summation order differs: |diff| <= 1e-5 * max|g| per parameter (a
    ~200-term FP32 sum is exact to ~200 * 2**-24 ~ 1e-5 of its terms); in BF16 each wgrad is rounded once
    to BF16 on either side, +2 * 2**-8 * |g| elementwise. Measured on this CPU: log-probs and loss bitwise
    equal, gradients within 1e-7 (FP32) / 1e-5 (BF16) of max|g|."""
    batch = make_batch()
    pad_engine, pad_m, pad_g, _ = step("bf16", dtype, False, emulate, batch)
    pf_engine, pf_m, pf_g, _ = step("bf16", dtype, True, emulate, batch)
    lp_tol = 1e-5 if dtype == torch.float32 else 2.0**-8
    mask = batch.response_mask
    assert (pf_m.old_logprobs[~mask] == 0).all()
    assert float((pad_m.old_logprobs - pf_m.old_logprobs).abs().max()) <= lp_tol
    assert abs(pad_m.metrics["loss"] - pf_m.metrics["loss"]) <= 1e-6 * max(abs(pad_m.metrics["loss"]), 1e-3)
    assert abs(pad_m.metrics["entropy"] - pf_m.metrics["entropy"]) <= 1e-5
    assert pad_g.keys() == pf_g.keys() and len(pad_g) == len(list(make_model().parameters()))
    rel = 0.0 if dtype == torch.float32 else 2 * 2.0**-8
    for name, g in pad_g.items():
        diff = (pf_g[name] - g).abs()
        assert torch.all(diff <= rel * g.abs() + 1e-5 * float(g.abs().max()) + 1e-12), name
    # the no-grad log-prob pass, and the same in chunks of rows
    for chunk in (0, 5):
        pad_engine.logprob_batch_size = pf_engine.logprob_batch_size = chunk
        assert float((pad_engine.logprobs(batch) - pf_engine.logprobs(batch)).abs().max()) <= lp_tol


def test_micro_batches_and_activation_checkpointing_compose_with_padding_free():
    """Micro-batches pack each sub-batch on its own; checkpointed blocks recompute with the same layout. The
    accumulated gradient is the one-pass gradient to FP32 summation order (tolerance as above)."""
    batch = make_batch()
    _, m0, g0, _ = step("bf16", torch.float32, True, False, batch)
    model = make_model()
    engine = NativeTrainingEngine(model, compute_dtype=torch.float32, optim=OptimSpec(grad_clip=0.0), padding_free=True,
                                  micro_batch_size=5, activation_checkpointing=True)
    grads = {}
    engine.optimizer.step = lambda: grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
    m1 = engine.train_step(batch).metrics
    assert abs(m0.metrics["loss"] - m1["loss"]) <= 1e-6
    for name, g in g0.items():
        assert torch.all((grads[name] - g).abs() <= 1e-5 * float(g.abs().max()) + 1e-12), name


def test_reference_policy_padding_free_logprobs():
    batch = make_batch()
    pad = ReferencePolicy(make_model(), device="cpu", compute_dtype=torch.float32).logprobs(batch)
    pf = ReferencePolicy(make_model(), device="cpu", compute_dtype=torch.float32, padding_free=True).logprobs(batch)
    assert float((pad - pf).abs().max()) <= 1e-5


def _e4m3_error(x: torch.Tensor) -> torch.Tensor:
    """Float64 bound on |Q(x) - x| per element of x [M, K] quantized in [128, 1] blocks (fp8rl_core.fp8's
    scales): E4M3 has 3 mantissa bits, so a value in the normal range (|x| / s >= 2**-6) rounds within
    2**-4 of itself; below it the step is 2**-9 * s (subnormals), half of it 2**-10 * s."""
    _, s = quantize_blockwise(x, COL)
    s = s.double().repeat_interleave(COL[0], 0)[: x.shape[0]]
    return 2.0**-4 * x.double().abs() + 2.0**-10 * s


def _deq64(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_blockwise(x, COL)
    return q.double() * s.double().repeat_interleave(COL[0], 0)[: x.shape[0]]


@pytest.mark.parametrize("dtype,emulate", [(torch.bfloat16, True), (torch.float32, False)], ids=["bf16", "fp32"])
def test_fp8_forward_equal_and_wgrad_within_the_block_bound(dtype, emulate):
    """fp8_e2e. Forward: X and W are quantized per token [1, 128] and per [128, 128] weight block, so the
    forward, and the log-probs, are the padded path's (tolerance as above). Backward: dgrad quantizes dY per
    token too, so every linear sees the same X and dY rows (the padded path has extra padding rows, whose
    dY is exactly 0). Only wgrad changes: dY and X are re-quantized in [128, 1] blocks along tokens, and the
    tokens of a block (and the padding rows' X, which set its amax) differ. Checked three ways:
    1. each path's dW is the blockwise formula Q(dY)[128,1]^T Q(X)[128,1] on its own rows (padded: B*T rows
       with the padding, padding-free: the N real rows), within FP32 accumulation ((M + 5) 2**-24 of the
       sum of |terms|, tests/fp8rl_core/fp8/test_linear.py);
    2. each is within the E4M3 bound of the exact dY^T X: with E(v) = 2**-4 |v| + 2**-10 s(v) per operand,
       |Q(g)Q(x) - gx| <= E(g)(|x| + E(x)) + |g| E(x), summed over tokens;
    3. hence |dW_padded - dW_padding_free| <= the sum of the two bounds, and they do differ (the blocks did)."""
    batch = make_batch()
    pad_engine, pad_m, pad_g, pad_a = step("fp8_e2e", dtype, False, emulate, batch, capture=True)
    pf_engine, pf_m, pf_g, pf_a = step("fp8_e2e", dtype, True, emulate, batch, capture=True)
    lp_tol = 1e-5 if dtype == torch.float32 else 2.0**-8
    assert float((pad_m.old_logprobs - pf_m.old_logprobs).abs().max()) <= lp_tol
    assert abs(pad_m.metrics["loss"] - pf_m.metrics["loss"]) <= 1e-6 * max(abs(pad_m.metrics["loss"]), 1e-3)
    real = batch.attention_mask.reshape(-1)
    assert len(pad_a) == 2 * 7
    differs = 0
    for name, (x_pad, g_pad) in pad_a.items():
        x_pf, g_pf = pf_a[name]
        assert x_pf.shape[0] == int(real.sum()) and x_pad.shape[0] == B * T
        assert (g_pad[~real] == 0).all()  # padding rows carry no gradient
        assert float((x_pad[real] - x_pf).abs().max()) <= 1e-5 * float(x_pf.abs().max())
        assert float((g_pad[real] - g_pf).abs().max()) <= 1e-5 * float(g_pf.abs().max())
        exact = g_pf.double().T @ x_pf.double()
        bounds = []
        for x, g, dw in ((x_pad, g_pad, pad_g[f"{name}.weight"]), (x_pf, g_pf, pf_g[f"{name}.weight"])):
            ref = _deq64(g).T @ _deq64(x)  # 1.
            acc = (x.shape[0] + 5) * 2.0**-24 * (_deq64(g).abs().T @ _deq64(x).abs())
            assert torch.all((dw.double() - ref).abs() <= acc + 1e-30), f"{name}: not the blockwise formula"
            ex, eg = _e4m3_error(x), _e4m3_error(g)  # 2.
            bound = eg.T @ (x.double().abs() + ex) + g.double().abs().T @ ex + acc
            assert torch.all((dw.double() - exact).abs() <= bound), f"{name}: outside the E4M3 bound"
            bounds.append(bound)
        diff = (pad_g[f"{name}.weight"].double() - pf_g[f"{name}.weight"].double()).abs()  # 3.
        assert torch.all(diff <= bounds[0] + bounds[1]), name
        differs += int(not torch.equal(pad_g[f"{name}.weight"], pf_g[f"{name}.weight"]))
    assert differs > 0  # packing did change the wgrad blocks


# ---- the run-config key ----------------------------------------------------------------------------------


def test_padding_free_enters_the_cell_id_only_when_set():
    default = load_run_config(None, [])
    explicit_off = load_run_config(None, ["train.padding_free=false"])
    on = load_run_config(None, ["train.padding_free=true"])
    assert default.train.padding_free is False and on.train.padding_free is True
    assert "padding_free" not in hashed_dict(default)["train"]  # every id written before the key is kept
    assert run_config_hash(explicit_off) == run_config_hash(default)
    assert hashed_dict(on)["train"]["padding_free"] is True
    for recipe in RECIPES:
        assert run_config_hash(load_run_config(None, [f"recipe={recipe}", "train.padding_free=true"])) != \
            run_config_hash(load_run_config(None, [f"recipe={recipe}"]))


def test_bad_values_name_the_key_and_what_is_allowed():
    with pytest.raises(ConfigError, match=r"train\.padding_free: expected true or false, got 'packed'"):
        load_run_config(None, ["train.padding_free=packed"])
    with pytest.raises(ConfigError, match=r"train\.padding_free: runs in the native training engine only; "
                                          r"engines.training is 'megatron'; valid: false, or engines.training native"):
        load_run_config(None, ["train.padding_free=true", "engines.training=megatron"])


def test_a_tiny_run_with_padding_free(tmp_path, monkeypatch):
    """The key reaches the trainer (its padding-free passes run) and a tiny fp8_e2e GRPO run completes."""
    from fp8rl_core.loop.run import run

    calls = []
    real_pack = native_train.pack
    monkeypatch.setattr(native_train, "pack", lambda mask: calls.append(mask.shape) or real_pack(mask))
    cfg = load_run_config(None, [
        f"output_dir={tmp_path / 'run'}", f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.steps=10",
        "warmstart.batch_size=16", "train.steps=2", "train.val_every=2", "train.checkpoint_every=2",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=3", "rollout.max_new_tokens=5",
        "task.val_size=6", "threads=1", "recipe=fp8_e2e", "loss.kl_coef=0.01", "train.padding_free=true"])
    run(cfg, progress=False)
    steps = {}
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "metrics":
            steps.setdefault(rec["step"], {}).update(rec["values"])
    assert sorted(steps) == [0, 1, 2]
    assert all(torch.isfinite(torch.tensor(steps[s]["loss"])) for s in (1, 2))
    assert len(calls) >= 4  # per step: the reference's and the training forward (warm start excluded)
    assert calls[-1][0] == 6  # P x G sequences per pass
