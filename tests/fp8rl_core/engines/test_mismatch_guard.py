"""The mismatch guard in the native training engine (train.mismatch_guard; fp8rl_core/engines/guard.py).

- mask: the step equals a float64 step on the batch with the masked sequences removed (loss and gradient),
  on the reuse path (old log-probs from the training forward) and the two-pass path, in one forward or in
  micro-batches (where the kept count is known only after the forwards: a rescale);
- skip (on the mismatch, on the gradient norm, or every sequence masked): weights, AdamW state, step count
  and the FP8 weight cache bitwise untouched, metrics still returned;
- inside the band: the guarded step is the unguarded one bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch
from _train_batches import B, make_batch

from fp8rl_core.algorithms import grpo
from fp8rl_core.algorithms.importance import compute_importance
from fp8rl_core.config import LossSpec, MismatchGuardSpec, OptimSpec
from fp8rl_core.config.recipe import BF16, RECIPES
from fp8rl_core.engines.base import TrainBatch
from fp8rl_core.engines.native_train import NativeTrainingEngine, token_logprobs
from fp8rl_core.model import ModelConfig, build_model

CFG = ModelConfig(vocab_size=32, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1)
LOSS = LossSpec(importance_sampling="token")  # IS weights on: the kept rows' weights must survive the mask
OPTIM = OptimSpec(grad_clip=0.0)
MAX = 1.1  # max_mismatch of these tests
# |train - gen| per row: rows 1 and 3 far over the band (e_b ~ exp(0.5), exp(0.7)), rows 0 and 2 inside it
OVER = torch.tensor([0.01, 0.5, 0.02, 0.7])
INSIDE = torch.full((B,), 0.01)
# float64 reference vs an FP32 engine: the loss is a mean of O(1) terms (FP32 rounding ~1e-7), gradients
# agree elementwise to FP32 reassociation relative to the tensor's largest entry (seen: ~1e-7 and ~1e-6)
LOSS_ATOL, GRAD_RTOL = 1e-6, 1e-5


def make_model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model(CFG)


def engine_for(guard: MismatchGuardSpec | None, micro_batch_size: int = 0, recipe=BF16, seed: int = 0,
               lr: float = 1e-3) -> NativeTrainingEngine:
    return NativeTrainingEngine(make_model(seed), recipe=recipe, loss=LOSS, optim=OptimSpec(lr=lr, grad_clip=0.0),
                                compute_dtype=torch.float32, micro_batch_size=micro_batch_size, guard=guard)


def guarded_batch(engine: NativeTrainingEngine, gap: torch.Tensor, two_pass: bool, seed: int = 1) -> TrainBatch:
    """make_batch with gen_logprobs = old - gap[b] - (small noise) on each response token, so that row b's
    token_mult_prob_error is about exp(gap[b]). two_pass: old_logprobs given (the current ones plus noise,
    so that the PPO ratio is not 1) with their IS weights; else left to the training forward (reuse path)."""
    batch = make_batch(CFG.vocab_size, seed)
    g = torch.Generator().manual_seed(seed + 10)
    now = engine.logprobs(batch)
    m = batch.response_mask
    old = torch.where(m, now + 0.05 * torch.randn(now.shape, generator=g), torch.zeros_like(now)) if two_pass else now
    gen = torch.where(m, old - gap[:, None] - 0.005 * torch.rand(now.shape, generator=g), torch.zeros_like(now))
    batch.gen_logprobs = gen
    if two_pass:
        batch.old_logprobs = old
        batch.is_weights = compute_importance(old, gen, m, "token").weights
    return batch


def importance(b: TrainBatch) -> torch.Tensor:
    return compute_importance(b.old_logprobs, b.gen_logprobs, b.response_mask, "token").weights


def step(engine: NativeTrainingEngine, batch: TrainBatch, two_pass: bool) -> dict[str, float]:
    return engine.train_step(batch, importance=None if two_pass else importance).metrics


def capture_grads(engine: NativeTrainingEngine) -> dict[str, torch.Tensor]:
    """The gradients the optimizer is handed (it does not step)."""
    grads: dict[str, torch.Tensor] = {}
    engine.optimizer.step = lambda: grads.update({n: p.grad.clone() for n, p in engine.model.named_parameters()})
    return grads


def reference64(model, batch: TrainBatch, rows: torch.Tensor, two_pass: bool):
    """Float64 loss and gradients of grpo.policy_loss on the batch reduced to `rows` (the sequences the guard
    keeps): an independent float64 copy of the model, log-softmax in float64."""
    twin = copy.deepcopy(model).double()
    sub = batch.select(rows)
    logits = twin(sub.input_ids, sub.attention_mask)
    lp, _ = token_logprobs(logits, sub.input_ids)
    m = sub.response_mask
    lp = torch.where(m, lp, torch.zeros_like(lp))
    old = sub.old_logprobs.double() if two_pass else lp.detach()
    w = compute_importance(old, sub.gen_logprobs.double(), m, "token").weights
    loss, _ = grpo.policy_loss(lp, old, sub.advantages.double(), m, w, clip_low=LOSS.clip_low,
                               clip_high=LOSS.clip_high)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in twin.named_parameters()}


@pytest.mark.parametrize("two_pass", [False, True], ids=["reuse", "two-pass"])
@pytest.mark.parametrize("micro_batch_size", [0, 1], ids=["one-forward", "micro-batches"])
def test_mask_equals_the_step_on_the_batch_without_the_masked_sequences(two_pass, micro_batch_size):
    engine = engine_for(MismatchGuardSpec(action="mask", max_mismatch=MAX), micro_batch_size)
    ref_model = copy.deepcopy(engine.model)
    batch = guarded_batch(engine, OVER, two_pass)
    grads = capture_grads(engine)
    metrics = step(engine, batch, two_pass)
    kept = torch.tensor([0, 2])
    loss, ref_grads = reference64(ref_model, batch, kept, two_pass)
    assert metrics["guard_masked_fraction"] == 0.5 and metrics["guard_skipped"] == 0.0
    assert metrics["guard_sequence_mismatch_max"] == pytest.approx(float(torch.exp(OVER.max())), rel=0.01)
    assert abs(metrics["loss"] - loss) <= LOSS_ATOL, (metrics["loss"], loss)
    for name, g in ref_grads.items():
        err = float((grads[name].double() - g).abs().max())
        assert err <= GRAD_RTOL * float(g.abs().max()) + 1e-12, f"{name}: gradient differs by {err:.3e}"
    # the whole batch's gradient is not the kept rows' one: the reference can tell the two apart
    _, whole = reference64(ref_model, batch, torch.arange(B), two_pass)
    assert any(float((whole[n] - g).abs().max()) > 100 * GRAD_RTOL * float(g.abs().max()) for n, g in ref_grads.items())


def snapshot(engine: NativeTrainingEngine) -> tuple[dict, dict, int]:
    return ({k: v.detach().clone() for k, v in engine.weights().items()},
            copy.deepcopy(engine.optimizer.state_dict()), engine.step)


def assert_untouched(engine: NativeTrainingEngine, before: tuple[dict, dict, int]) -> None:
    weights, optim, steps = before
    assert engine.step == steps
    assert all(torch.equal(weights[k], v) for k, v in engine.weights().items())
    now = engine.optimizer.state_dict()["state"]
    assert now.keys() == optim["state"].keys() and now
    for i, s in optim["state"].items():
        assert all(torch.equal(s[k], now[i][k]) for k in s), i
    assert all(p.grad is None for p in engine.model.parameters())


# (guard, the gap of the skipped step's batch, the reason it must name)
SKIPS = {"mismatch": (MismatchGuardSpec(action="skip", max_mismatch=MAX), OVER, "guard_skip_mismatch"),
         "grad-norm": (MismatchGuardSpec(max_grad_norm=1e-6), INSIDE, "guard_skip_grad_norm"),
         "all-masked": (MismatchGuardSpec(action="mask", max_mismatch=MAX), torch.full((B,), 0.5),
                        "guard_skip_all_masked")}


@pytest.mark.parametrize("micro_batch_size", [0, 2], ids=["one-forward", "micro-batches"])
@pytest.mark.parametrize("why", list(SKIPS))
def test_a_skipped_step_changes_nothing_and_still_reports(why, micro_batch_size):
    guard, gap, reason = SKIPS[why]
    engine = engine_for(None, micro_batch_size)
    step(engine, guarded_batch(engine, INSIDE, two_pass=False), two_pass=False)  # AdamW state to protect
    engine.guard_spec = guard  # from here on guarded
    before = snapshot(engine)
    metrics = step(engine, guarded_batch(engine, gap, two_pass=False, seed=2), two_pass=False)
    assert_untouched(engine, before)
    assert metrics["guard_skipped"] == 1.0 and metrics[reason] == 1.0
    assert sum(v for k, v in metrics.items() if k.startswith("guard_skip_")) == 1.0
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    if why == "all-masked":  # nothing in the loss: zero gradient, all sequences reported masked
        assert metrics["guard_masked_fraction"] == 1.0 and metrics["grad_norm"] == 0.0
    else:  # the step's loss and gradient norm were still measured
        assert metrics["grad_norm"] > 0 and metrics["guard_mismatch"] > 1.0
    # an update afterwards still works (the guard lifted), from the untouched state
    engine.guard_spec = None
    step(engine, guarded_batch(engine, INSIDE, two_pass=False, seed=3), two_pass=False)
    assert engine.step == before[2] + 1


def count_weight_quantizations(monkeypatch) -> list[int]:
    from fp8rl_core.fp8 import linear

    calls, real = [0], linear.quantize_weight

    def counted(*args, **kw):
        calls[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(linear, "quantize_weight", counted)
    return calls


def test_a_skipped_step_keeps_the_fp8_weight_cache(monkeypatch):
    """Q(W) is cached per weight version and optimizer step: a skip changes neither, so the next forward
    re-quantizes nothing and gives the same log-probs; after an applied step it re-quantizes (control)."""
    engine = engine_for(MismatchGuardSpec(action="skip", max_mismatch=MAX), recipe=RECIPES["fp8_e2e"])
    batch = guarded_batch(engine, OVER, two_pass=False)
    before = engine.logprobs(batch)
    calls = count_weight_quantizations(monkeypatch)
    assert step(engine, batch, two_pass=False)["guard_skipped"] == 1.0
    assert calls[0] == 0 and torch.equal(engine.logprobs(batch), before) and calls[0] == 0
    step(engine, guarded_batch(engine, INSIDE, two_pass=False), two_pass=False)
    calls[0] = 0
    engine.logprobs(batch)
    assert calls[0] == len(engine.fp8_modules) > 0


@pytest.mark.parametrize("micro_batch_size", [0, 2], ids=["one-forward", "micro-batches"])
@pytest.mark.parametrize("two_pass", [False, True], ids=["reuse", "two-pass"])
@pytest.mark.parametrize("action", ["skip", "mask"])
def test_inside_the_band_the_step_is_the_unguarded_one_bit_for_bit(action, two_pass, micro_batch_size):
    guard = MismatchGuardSpec(action=action, max_mismatch=MAX, max_grad_norm=1e6)
    plain, guarded = engine_for(None, micro_batch_size), engine_for(guard, micro_batch_size)
    for seed in (1, 2):  # two steps: the second starts from AdamW state
        a, b = (guarded_batch(e, INSIDE, two_pass, seed) for e in (plain, guarded))
        ma, mb = step(plain, a, two_pass), step(guarded, b, two_pass)
        assert mb["guard_skipped"] == 0.0 and mb["guard_masked_fraction"] == 0.0
        assert 1.0 < mb["guard_mismatch"] < MAX
        same = {k for k in ma if not k.endswith("_per_s")}
        assert {k: ma[k] for k in same} == {k: mb[k] for k in same}
        assert set(mb) - set(ma) == {"guard_skipped", "guard_masked_fraction", "guard_mismatch",
                                     "guard_sequence_mismatch_max", "guard_skip_mismatch", "guard_skip_grad_norm",
                                     "guard_skip_all_masked"}
    wa, wb = plain.weights(), guarded.weights()
    assert plain.step == guarded.step == 2 and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_off_guard_adds_no_metric_and_a_mismatch_action_needs_gen_logprobs():
    engine = engine_for(MismatchGuardSpec(action="none", max_grad_norm=0.0))
    assert engine.guard_spec is None
    batch = make_batch(CFG.vocab_size)
    assert not any(k.startswith("guard_") for k in engine.train_step(batch).metrics)
    engine = engine_for(MismatchGuardSpec(action="mask"))
    with pytest.raises(ValueError, match="mismatch_guard.action=mask: the batch needs gen_logprobs"):
        engine.train_step(batch)
    # the gradient-norm guard alone does not need them
    assert engine_for(MismatchGuardSpec(max_grad_norm=1e6)).train_step(batch).metrics["guard_skipped"] == 0.0
