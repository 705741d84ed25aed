"""GRPO advantages, IS weights and the clipped policy loss against hand-written float64 references.

The references below are plain-Python loops over the formulas of docs/design.md (no call into the code
under test); tolerances are stated where float32 meets float64.
"""
from __future__ import annotations

import math
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl_core.algorithms import grpo
from fp8rl_core.algorithms.grpo import (
    IS_VARIANTS,
    compute_importance,
    group_advantages,
    importance_stats,
    importance_weights,
    importance_weights_with_stats,
    k3_kl,
    masked_mean,
    policy_loss,
    rollout_kl,
)
from fp8rl_core.algorithms.importance import NEEDS_ADVANTAGES, importance_from_config
from fp8rl_core.config import ISVariant

VARIANTS = ["none", "token", "tis", "icepop", "sequence"]
FAST = settings(max_examples=40, deadline=None)


# ---------------------------------------------------------------- group advantages


def ref_advantages(rows: list[list[float]]) -> list[list[float]]:
    """Leave-one-out baseline and population std, written out per sample (docs/design.md)."""
    out = []
    for r in rows:
        g = len(r)
        row = []
        for i in range(g):
            if g == 1:
                row.append(0.0)
                continue
            others = [r[j] for j in range(g) if j != i]
            b = sum(others) / len(others)
            s = math.sqrt(sum((x - b) ** 2 for x in others) / len(others))
            flat = all(x == others[0] for x in others)  # s is exactly 0 in real arithmetic
            row.append(r[i] - b if flat else (r[i] - b) / (s + 1e-6))
        out.append(row)
    return out


def test_advantages_hand_computed():
    # group 1: b_0 = 1/3 (others 0, 0, 1), s_0 = sqrt(1/3 - 1/9) = sqrt(2)/3 -> A_0 = (2/3) / (sqrt(2)/3 + 1e-6)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards)
    assert adv.dtype == torch.float32 and adv.shape == (3, 4)
    a0 = (2 / 3) / (math.sqrt(2) / 3 + 1e-6)
    assert adv[0, 0].item() == pytest.approx(a0, rel=1e-6)
    assert adv[0, 1].item() == pytest.approx(-a0, rel=1e-6)
    assert torch.equal(adv[1], torch.zeros(4))  # all equal: no signal
    # group 3: the lone 1 sees three 0s -> s = 0 -> A = 1 - 0 = 1 (no division)
    assert adv[2, 3].item() == pytest.approx(1.0, abs=1e-7)
    # a 0 sees {0, 0, 1}: b = 1/3, s = sqrt(2)/3
    assert adv[2, 0].item() == pytest.approx((-1 / 3) / (math.sqrt(2) / 3 + 1e-6), rel=1e-6)


def test_advantages_rounding_of_equal_others_is_not_a_tiny_std():
    # mean(0.1, 0.1, 0.1) != 0.1 in floating point; that residue must not become a 1e6x advantage
    rewards = torch.tensor([[0.1, 0.1, 0.1, 1.0]], dtype=torch.float64)
    adv = group_advantages(rewards)
    assert adv[0, 3].item() == pytest.approx(0.9, abs=1e-12)
    assert torch.allclose(adv, torch.tensor(ref_advantages(rewards.tolist()), dtype=torch.float64), atol=1e-9)


def test_g1_gives_zero_and_g2_gives_difference():
    assert torch.equal(group_advantages(torch.tensor([[3.0], [0.0]])), torch.zeros(2, 1))
    adv = group_advantages(torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
    assert adv.tolist() == [[1.0, -1.0], [0.0, 0.0]]  # s_i = 0 for G = 2: A_i = r_i - r_j


def test_advantages_int_rewards_and_errors():
    assert group_advantages(torch.tensor([[1, 0]])).dtype == torch.float32
    with pytest.raises(ValueError, match=r"\[P prompts, G samples\]"):
        group_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))


reward_rows = st.integers(1, 6).flatmap(
    lambda g: st.lists(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, -1.0, 2.0]), min_size=g, max_size=g),
                       min_size=1, max_size=4))


@FAST
@given(reward_rows)
def test_advantages_match_reference(rows):
    adv = group_advantages(torch.tensor(rows, dtype=torch.float64))
    assert torch.allclose(adv, torch.tensor(ref_advantages(rows), dtype=torch.float64), atol=1e-9)


@FAST
@given(reward_rows, st.integers(-5, 5))
def test_advantages_shift_invariant(rows, shift):
    r = torch.tensor(rows, dtype=torch.float64)
    assert torch.allclose(group_advantages(r + shift), group_advantages(r), atol=1e-9)


@FAST
@given(reward_rows, st.randoms(use_true_random=False))
def test_advantages_permutation_equivariant(rows, rnd):
    r = torch.tensor(rows, dtype=torch.float64)
    perm = list(range(r.shape[1]))
    rnd.shuffle(perm)
    assert torch.allclose(group_advantages(r[:, perm]), group_advantages(r)[:, perm], atol=1e-12)


# ---------------------------------------------------------------- importance weights

# one sequence: three valid tokens (log-ratios +0.5, -1, 0) and one padded token with a garbage gen value
TRAIN = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
GEN = torch.tensor([[-1.5, -1.0, -0.5, -9.0]])
MASK = torch.tensor([[True, True, True, False]])
E5, EM1 = math.exp(0.5), math.exp(-1.0)


@pytest.mark.parametrize("variant,kw,expected", [
    ("none", {}, [1.0, 1.0, 1.0, 0.0]),
    ("token", {}, [E5, EM1, 1.0, 0.0]),
    ("tis", {"cap": 1.5}, [1.5, EM1, 1.0, 0.0]),
    ("tis", {"cap": 2.0}, [E5, EM1, 1.0, 0.0]),
    ("icepop", {"low": 0.5, "high": 1.6}, [0.0, 0.0, 1.0, 0.0]),  # e^0.5 = 1.649 > 1.6; e^-1 = 0.368 < 0.5
    ("icepop", {"low": 0.3, "high": 2.0}, [E5, EM1, 1.0, 0.0]),
    ("sequence", {}, [math.exp(-1 / 6)] * 3 + [0.0]),  # exp(mean(0.5, -1, 0))
])
def test_importance_weights_hand_computed(variant, kw, expected):
    w = importance_weights(TRAIN, GEN, MASK, variant, **kw)
    assert w.shape == (1, 4) and w.dtype == torch.float32
    assert torch.allclose(w, torch.tensor([expected]), rtol=1e-6, atol=0)


def test_importance_stats_hand_computed():
    isw = compute_importance(TRAIN, GEN, MASK, "tis", cap=1.5)
    s = importance_stats(isw)
    assert s["is_weight_mean"] == pytest.approx((1.5 + EM1 + 1.0) / 3, rel=1e-6)
    assert s["is_weight_max"] == pytest.approx(1.5)
    assert s["is_raw_weight_mean"] == pytest.approx((E5 + EM1 + 1.0) / 3, rel=1e-6)
    assert s["is_raw_weight_max"] == pytest.approx(E5, rel=1e-6)
    assert s["is_fraction_truncated"] == pytest.approx(1 / 3) and s["is_fraction_masked"] == 0.0
    _, s = importance_weights_with_stats(TRAIN, GEN, MASK, "icepop", low=0.5, high=1.6)
    assert s["is_fraction_masked"] == pytest.approx(2 / 3) and s["is_fraction_truncated"] == 0.0
    assert s["is_weight_mean"] == pytest.approx(1 / 3)
    _, s = importance_weights_with_stats(TRAIN, GEN, MASK, "none")
    assert s["is_weight_mean"] == 1.0 and s["is_fraction_truncated"] == s["is_fraction_masked"] == 0.0
    _, s = importance_weights_with_stats(TRAIN, GEN, torch.zeros_like(MASK), "token")
    assert set(s.values()) == {0.0}


def test_non_finite_weights_become_zero_and_count_as_masked():
    train = torch.tensor([[-1.0, -1.0, float("nan")], [-1.0, -1.0, -1.0]])
    gen = torch.tensor([[-1.0, -float("inf"), -1.0], [-1.0, -1.0, -1.0]])  # +inf and NaN log-ratios
    mask = torch.ones(2, 3, dtype=torch.bool)
    for variant in ("token", "tis", "icepop"):
        isw = compute_importance(train, gen, mask, variant)
        assert isw.weights.tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]], variant
        assert importance_stats(isw)["is_fraction_masked"] == pytest.approx(2 / 6), variant
    isw = compute_importance(train, gen, mask, "sequence")  # a bad token zeroes its whole sequence
    assert isw.weights.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert importance_stats(isw)["is_fraction_masked"] == pytest.approx(3 / 6)


@FAST
@given(st.sampled_from(VARIANTS), st.integers(0, 2**31 - 1))
def test_masked_positions_never_matter_for_weights(variant, seed):
    g = torch.Generator().manual_seed(seed)
    train, gen = -torch.rand(3, 5, generator=g) * 2, -torch.rand(3, 5, generator=g) * 2
    mask = torch.rand(3, 5, generator=g) < 0.6
    garbage = torch.where(torch.rand(3, 5, generator=g) < 0.5, float("nan"), float("inf"))
    w1 = importance_weights(train, gen, mask, variant)
    w2 = importance_weights(torch.where(mask, train, garbage), torch.where(mask, gen, -garbage), mask, variant)
    assert torch.equal(w1, w2)
    assert torch.all(w1[~mask] == 0)


def test_weights_are_detached_and_keep_float64():
    train = TRAIN.double().requires_grad_()
    for variant in VARIANTS:
        w = importance_weights(train, GEN.double(), MASK.int(), variant)  # 0/1 masks work too
        assert not w.requires_grad and w.dtype == torch.float64


def test_unknown_variant_and_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="unknown variant 'gspo'.*none, token, tis, icepop, sequence"):
        importance_weights(TRAIN, GEN, MASK, "gspo")
    with pytest.raises(ValueError, match="gen_logprobs has shape"):
        importance_weights(TRAIN, GEN[:, :3], MASK, "token")
    with pytest.raises(ValueError, match="cap > 0"):
        importance_weights(TRAIN, GEN, MASK, "tis", cap=0.0)


# ---------------------------------------------------------------- issue 34: TRL's and prime-rl's corrections


def _mis_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(6, 7, generator=g, dtype=torch.float64) * 3
    train = gen + (torch.rand(6, 7, generator=g, dtype=torch.float64) - 0.5) * 1.6
    mask = torch.rand(6, 7, generator=g) < 0.7
    mask[:, 0] = True
    adv = torch.tensor([1.5, -0.7, 0.0, 2.0, -1.0, 0.3], dtype=torch.float64)
    return train, gen, mask, adv


def ref_seq_mask(train, gen, mask, low, high):
    """TRL sequence_mask, per row: s = exp(sum over valid tokens of (train - gen)); the row's valid tokens
    get s when low <= s <= high, else 0."""
    out = []
    for tr, ge, m in zip(train, gen, mask):
        s = math.exp(sum(a - b for a, b, k in zip(tr, ge, m) if k))
        out.append([(s if low <= s <= high else 0.0) if k else 0.0 for k in m])
    return out


def ref_dppo(train, gen, mask, adv, low, high):
    """prime-rl default_loss_fn, per token: dp = e^train - e^gen; masked if dp > high where A > 0, dp < -low
    where A <= 0; the weight is exp(train - gen) where kept, 0 where masked."""
    out = []
    for tr, ge, m, a in zip(train, gen, mask, adv):
        row = []
        for x, y, k in zip(tr, ge, m):
            dp = math.exp(x) - math.exp(y)
            bad = dp > high if a > 0 else dp < -low
            row.append(math.exp(x - y) if k and not bad else 0.0)
        out.append(row)
    return out


@pytest.mark.parametrize("low,high", [(0.0, 3.0), (0.5, 2.0), (0.9, 1.1)])
def test_seq_mask_matches_trl_reference(low, high):
    train, gen, mask, _ = _mis_case()
    isw = compute_importance(train, gen, mask, "seq_mask", seq_low=low, seq_high=high)
    exp = ref_seq_mask(train.tolist(), gen.tolist(), mask.tolist(), low, high)
    assert torch.allclose(isw.weights, torch.tensor(exp, dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.equal(isw.masked, mask & (isw.weights == 0))
    if (low, high) == (0.5, 2.0):  # the bounds bite: some rows kept, some masked
        assert 0 < int(isw.masked.any(-1).sum()) < 6


def test_seq_mask_is_the_product_not_the_geometric_mean():
    ln2 = math.log(2.0)
    train = torch.tensor([[ln2, ln2, 5.0], [ln2, -ln2, 0.0]], dtype=torch.float64)  # token ratios 2, 2 | 2, 1/2
    gen = torch.zeros_like(train)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    w = compute_importance(train, gen, mask, "seq_mask").weights  # TRL's defaults: [0, 3]
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]  # 2 * 2 = 4 > 3: masked (the mean, 2, would pass)
    w = compute_importance(train, gen, mask, "seq_mask", seq_high=5.0).weights
    assert w[0].tolist() == [pytest.approx(4.0, rel=1e-15)] * 2 + [0.0]
    w = compute_importance(train, gen, mask, "seq_mask", seq_low=1.5, seq_high=5.0).weights
    assert w[1].tolist() == [0.0, 0.0, 0.0]  # the lower bound: 1 < 1.5


def test_seq_mask_non_finite_sequence_is_masked():
    train = torch.tensor([[-1.0, float("nan")], [-1.0, -1.0]])
    gen = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    isw = compute_importance(train, gen, torch.ones(2, 2, dtype=torch.bool), "seq_mask")
    assert isw.weights.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert importance_stats(isw)["is_fraction_masked"] == 0.5


@pytest.mark.parametrize("low,high", [(0.2, 0.2), (0.05, 0.1)])
def test_dppo_matches_prime_rl_reference(low, high):
    train, gen, mask, adv = _mis_case(1)
    for a in (adv, adv[:, None].expand_as(train)):  # [B] or [B, T]
        isw = compute_importance(train, gen, mask, "dppo", prob_low=low, prob_high=high, advantages=a)
        exp = ref_dppo(train.tolist(), gen.tolist(), mask.tolist(), adv.tolist(), low, high)
        assert torch.allclose(isw.weights, torch.tensor(exp, dtype=torch.float64), rtol=1e-12, atol=0)
        assert torch.equal(isw.masked, mask & (isw.weights == 0))
    assert isw.masked.any()  # the case exercises the mask


def test_dppo_sign_convention_by_hand():
    # p_train - p_gen = +0.3 (rose) and -0.3 (fell), under a positive, a negative and a zero advantage
    gen = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5, 0.5, 0.5]], dtype=torch.float64))
    train = torch.log(torch.tensor([[0.8, 0.2, 0.8, 0.2, 0.8, 0.2]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0, 0.0]], dtype=torch.float64)
    isw = compute_importance(train, gen, torch.ones(1, 6, dtype=torch.bool), "dppo", advantages=adv)
    # A > 0: masked where it rose (> 0.2); A < 0 and A = 0 (prime-rl: not positive): masked where it fell
    assert isw.masked.tolist() == [[True, False, False, True, False, True]]
    assert isw.weights[0, 1].item() == pytest.approx(0.4, rel=1e-12)  # kept: w = 0.2 / 0.5


def test_dppo_without_advantages_is_a_clear_error():
    train, gen, mask, _ = _mis_case()
    assert NEEDS_ADVANTAGES == {"dppo"}
    with pytest.raises(ValueError, match="'dppo' masks by the sign of each token's advantage.*advantages="):
        compute_importance(train, gen, mask, "dppo")
    with pytest.raises(ValueError, match="advantages has shape"):
        compute_importance(train, gen, mask, "dppo", advantages=torch.zeros(3))
    for variant in VARIANTS:  # the others ignore advantages
        assert torch.equal(importance_weights(train, gen, mask, variant),
                           importance_weights(train, gen, mask, variant, advantages=torch.ones(6)))


def test_importance_from_config_reads_every_knob():
    from fp8rl_core.config import LossSpec

    train, gen, mask, adv = _mis_case(2)
    spec = LossSpec(importance_sampling="dppo", is_prob_low=0.05, is_prob_high=0.1)
    got = importance_from_config(spec, train, gen, mask, adv).weights
    assert torch.equal(got, importance_weights(train, gen, mask, "dppo", prob_low=0.05, prob_high=0.1,
                                               advantages=adv))
    spec = LossSpec(importance_sampling="seq_mask", is_seq_low=0.9, is_seq_high=1.1)
    assert torch.equal(importance_from_config(spec, train, gen, mask).weights,
                       importance_weights(train, gen, mask, "seq_mask", seq_low=0.9, seq_high=1.1))


@FAST
@given(st.sampled_from(["seq_mask", "dppo"]), st.integers(0, 2**31 - 1))
def test_masked_positions_never_matter_for_the_new_weights(variant, seed):
    g = torch.Generator().manual_seed(seed)
    train, gen = -torch.rand(3, 5, generator=g) * 2, -torch.rand(3, 5, generator=g) * 2
    mask = torch.rand(3, 5, generator=g) < 0.6
    adv = torch.randn(3, 5, generator=g)
    garbage = torch.where(torch.rand(3, 5, generator=g) < 0.5, float("nan"), float("inf"))
    w1 = importance_weights(train, gen, mask, variant, advantages=adv)
    w2 = importance_weights(torch.where(mask, train, garbage), torch.where(mask, gen, -garbage), mask, variant,
                            advantages=torch.where(mask, adv, garbage))
    assert torch.equal(w1, w2) and torch.all(w1[~mask] == 0) and not w1.requires_grad


def test_registry_matches_config_choices():
    assert set(IS_VARIANTS) == set(typing.get_args(ISVariant))
    with pytest.raises(ValueError, match="already registered"):
        grpo.register_is_variant("token")(lambda *a: None)


# ---------------------------------------------------------------- k3 KL and masked mean


def test_k3_hand_computed_and_clamped():
    lp = torch.tensor([-1.0, -2.0, -1.0, 0.0])
    ref = torch.tensor([-1.0, -1.0, -3.0, -30.0])
    d = [0.0, 1.0, -2.0, -10.0]  # ref - lp, the last clamped from -30
    expected = [math.exp(x) - x - 1 for x in d]
    assert torch.allclose(k3_kl(lp, ref, clamp=10.0), torch.tensor(expected), rtol=1e-6)
    assert k3_kl(lp, ref, clamp=None)[3].item() == pytest.approx(math.exp(-30) + 29, rel=1e-6)


@FAST
@given(st.lists(st.floats(-8, 0), min_size=1, max_size=6), st.lists(st.floats(-8, 0), min_size=6, max_size=6))
def test_k3_is_non_negative(lp, ref):
    assert torch.all(k3_kl(torch.tensor(lp, dtype=torch.float64), torch.tensor(ref[:len(lp)], dtype=torch.float64))
                     >= 0)


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    assert masked_mean(x, m).item() == pytest.approx((1 + 2 + 4 + 6) / 4)
    assert masked_mean(x, m, dim=1).tolist() == [1.5, 5.0]
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


# ---------------------------------------------------------------- policy loss


def ref_policy_loss(lp, old, adv, mask, w, clip_low, clip_high, ref, kl_coef, kl_clamp):
    """Per-token loop in float64: -min(r A, clip(r) A) * w + kl_coef * k3, summed / n valid tokens."""
    total_pg = total_kl = 0.0
    n = clipped = 0
    ratios = []
    for b in range(len(lp)):
        for t in range(len(lp[b])):
            if not mask[b][t]:
                continue
            n += 1
            r = math.exp(lp[b][t] - old[b][t])
            rc = min(max(r, 1 - clip_low), 1 + clip_high)
            a = adv[b][t]
            total_pg += -min(r * a, rc * a) * w[b][t]
            clipped += int(rc * a < r * a)  # the clipped branch is the min: zero gradient
            ratios.append(r)
            if ref is not None:
                d = min(max(ref[b][t] - lp[b][t], -kl_clamp), kl_clamp)
                total_kl += math.exp(d) - d - 1
    pg, kl = total_pg / n, total_kl / n
    return pg + kl_coef * kl, {"pg_loss": pg, "kl": kl, "clip_fraction": clipped / n,
                               "ratio_mean": sum(ratios) / n, "ratio_max": max(ratios)}


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    old = lp + (torch.rand(3, 5, generator=g, dtype=torch.float64) - 0.5) * 1.2  # ratios in ~[0.55, 1.8]
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5).contiguous()
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    w = torch.rand(3, 5, generator=g, dtype=torch.float64) + 0.5
    ref = lp - torch.rand(3, 5, generator=g, dtype=torch.float64)
    return lp, old, adv, mask, w, ref


@pytest.mark.parametrize("clip_low,clip_high,kl_coef", [(0.2, 0.2, 0.0), (0.1, 0.3, 0.05), (0.2, 0.28, 1.0)])
def test_policy_loss_matches_reference(clip_low, clip_high, kl_coef):
    lp, old, adv, mask, w, ref = _case()
    loss, metrics = policy_loss(lp.clone().requires_grad_(), old, adv, mask, w, clip_low=clip_low,
                                clip_high=clip_high, ref_logprobs=ref, kl_coef=kl_coef, kl_clamp=10.0)
    exp_loss, exp = ref_policy_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), w.tolist(),
                                    clip_low, clip_high, ref.tolist(), kl_coef, 10.0)
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12)
    assert metrics["loss"] == pytest.approx(exp_loss, rel=1e-12)
    for k, v in exp.items():
        assert metrics[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    assert 0 < metrics["clip_fraction"] < 1  # the case exercises both branches


def test_policy_loss_gradient_by_hand():
    # d/dlp of w * max(-A r, -A clip(r)) is -A r w where the unclipped branch is active, else 0;
    # d/dlp of k3(ref - lp) = 1 - exp(ref - lp) (inside the clamp)
    lp, old, adv, mask, w, ref = _case(1)
    x = lp.clone().requires_grad_()
    loss, _ = policy_loss(x, old, adv, mask, w, ref_logprobs=ref, kl_coef=0.1)
    loss.backward()
    r = torch.exp(lp - old)
    clipped_active = ((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))
    n = int(mask.sum())
    pg_grad = torch.where(clipped_active, 0.0, -adv * r * w)
    expected = torch.where(mask, pg_grad + 0.1 * (1 - torch.exp(ref - lp)), 0.0) / n
    assert torch.allclose(x.grad, expected, rtol=1e-12, atol=1e-15)


def test_policy_loss_clip_fraction_hand_cases():
    # A>0, r=1.5 -> clipped; A<0, r=0.5 -> clipped; A>0, r=0.5 -> unclipped; A<0, r=1.5 -> unclipped; A=0 -> no
    r = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.5]])
    lp = torch.log(r)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 0.0]])
    loss, m = policy_loss(lp, torch.zeros_like(lp), adv, torch.ones(1, 5, dtype=torch.bool))
    assert m["clip_fraction"] == pytest.approx(2 / 5)
    # per-token loss: -1.2, -(-0.8)=0.8, -0.5, 1.5, 0
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 0.5 + 1.5 + 0.0) / 5, rel=1e-6)
    assert m["ratio_max"] == pytest.approx(1.5) and m["ratio_mean"] == pytest.approx(5.5 / 5)


def test_on_policy_loss_is_reinforce():
    lp, _, adv, mask, w, _ = _case(2)
    x = lp.clone().requires_grad_()
    loss, m = policy_loss(x, lp, adv, mask, w)
    n = int(mask.sum())
    assert loss.item() == pytest.approx(float(-(adv * w)[mask].sum()) / n, rel=1e-12)
    loss.backward()
    assert torch.allclose(x.grad, torch.where(mask, -adv * w, 0.0) / n, rtol=1e-12)
    assert m["clip_fraction"] == 0.0 and m["ratio_mean"] == 1.0 and m["kl"] == 0.0


@FAST
@given(st.integers(0, 2**31 - 1))
def test_masked_positions_never_matter_for_loss(seed):
    lp, old, adv, mask, w, ref = _case(seed)
    junk = torch.full_like(lp, float("nan"))

    def run(lp_, old_, adv_, w_, ref_):
        x = lp_.clone().requires_grad_()
        loss, m = policy_loss(x, old_, adv_, mask, w_, ref_logprobs=ref_, kl_coef=0.1)
        loss.backward()
        return loss, m, x.grad

    a = run(lp, old, adv, w, ref)
    pick = lambda t: torch.where(mask, t, junk)  # noqa: E731
    b = run(pick(lp), pick(old), pick(adv), pick(w), pick(ref))
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert torch.equal(a[2], b[2]) and torch.all(b[2][~mask] == 0)


def test_policy_loss_options():
    lp, old, adv, mask, w, _ = _case(3)
    base, _ = policy_loss(lp, old, adv, mask)
    ones, _ = policy_loss(lp, old, adv, mask, torch.ones_like(lp))
    assert torch.equal(base, ones)  # is_weights=None means 1
    row_adv, _ = policy_loss(lp, old, adv[:, 0], mask)
    assert torch.equal(row_adv, base)  # [B] advantages broadcast over tokens
    glob, _ = policy_loss(lp, old, adv, mask, num_tokens=100)
    assert glob.item() == pytest.approx(base.item() * int(mask.sum()) / 100, rel=1e-12)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(lp, old, adv[:, :2], mask)
    with pytest.raises(ValueError, match="same \\[B, T\\] shape"):
        policy_loss(lp, old[:2], adv, mask)


def test_policy_loss_empty_mask_is_zero_with_a_graph():
    lp = torch.randn(2, 3, requires_grad=True)
    loss, m = policy_loss(lp, lp.detach(), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(lp.grad, torch.zeros(2, 3))
    assert set(m.values()) == {0.0}


def test_policy_loss_float32_matches_float64_reference():
    lp, old, adv, mask, w, ref = _case(4)
    loss, m = policy_loss(lp.float(), old.float(), adv.float(), mask, w.float(), ref_logprobs=ref.float(),
                          kl_coef=0.01)
    exp_loss, _ = ref_policy_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), w.tolist(),
                                  0.2, 0.2, ref.tolist(), 0.01, 10.0)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(exp_loss, rel=1e-5, abs=1e-6)  # float32 rounding


def test_policy_loss_rejects_a_kl_without_reference_and_bad_normalizer():
    lp, old, adv, mask, _, _ = _case(5)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprobs"):
        policy_loss(lp, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        policy_loss(lp, old, adv, mask, num_tokens=0)


def test_rollout_kl_term_matches_a_float64_reference():
    """L += rollout_kl_coef * (1/n) sum_valid 0.5 (lp - gen)^2 (prime-rl's squared log-ratio, with the k2 ½);
    its gradient coef * (lp - gen) / n; `rollout_kl` reported without the coefficient."""
    lp, old, adv, mask, w, ref = _case(7)
    gen = lp + (torch.rand(3, 5, generator=torch.Generator().manual_seed(7), dtype=torch.float64) - 0.5)
    x = lp.clone().requires_grad_()
    loss, m = policy_loss(x, old, adv, mask, w, gen_logprobs=gen, rollout_kl_coef=0.3)
    base, _ = ref_policy_loss(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), w.tolist(), 0.2, 0.2,
                              None, 0.0, 10.0)
    pairs = [(a, b) for ra, rb, rm in zip(lp.tolist(), gen.tolist(), mask.tolist()) for a, b, k in zip(ra, rb, rm) if k]
    k2 = sum(0.5 * (a - b) ** 2 for a, b in pairs) / len(pairs)
    assert loss.item() == pytest.approx(base + 0.3 * k2, rel=1e-12)
    assert m["rollout_kl"] == pytest.approx(k2, rel=1e-12) and m["loss"] == pytest.approx(base + 0.3 * k2, rel=1e-12)
    loss.backward()
    x0 = lp.clone().requires_grad_()
    policy_loss(x0, old, adv, mask, w)[0].backward()
    extra = torch.where(mask, 0.3 * (lp - gen), 0.0) / len(pairs)
    assert torch.allclose(x.grad - x0.grad, extra, rtol=1e-10, atol=1e-15)
    assert torch.equal(rollout_kl(lp, gen), 0.5 * (lp - gen) ** 2)


def test_rollout_kl_term_is_off_by_default_and_needs_gen_logprobs():
    lp, old, adv, mask, w, _ = _case(8)
    base, m0 = policy_loss(lp, old, adv, mask, w)
    same, m1 = policy_loss(lp, old, adv, mask, w, gen_logprobs=lp - 0.1)  # coefficient 0: reported only
    assert torch.equal(base, same) and "rollout_kl" not in m0 and m1["rollout_kl"] == pytest.approx(0.005)
    with pytest.raises(ValueError, match="rollout_kl_coef=0.1 needs gen_logprobs"):
        policy_loss(lp, old, adv, mask, rollout_kl_coef=0.1)


def test_micro_batch_shares_add_up_to_the_global_loss():
    lp, old, adv, mask, w, ref = _case(6)
    full, _ = policy_loss(lp, old, adv, mask, w, ref_logprobs=ref, kl_coef=0.05)
    n = int(mask.sum())
    parts = [policy_loss(lp[r], old[r], adv[r], mask[r], w[r], ref_logprobs=ref[r], kl_coef=0.05, num_tokens=n)[0]
             for r in (slice(0, 1), slice(1, 3))]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), rel=1e-12)
