"""Mismatch and per-step metrics against hand-computed float64 values."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl_core.algorithms.metrics import masked_entropy, mismatch_stats, reward_stats, token_mult_prob_error

NAN, INF = float("nan"), float("inf")
# sequence 0: 3 valid tokens, sequence 1: 1 valid token; off-mask entries are junk that must be ignored
TRAIN = torch.tensor([[-1.0, -2.0, -0.5, NAN], [-0.1, INF, 0.0, 0.0]])
GEN = torch.tensor([[-1.1, -2.0, -0.2, 0.0], [-0.6, 0.0, -INF, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, False, False, False]])
DIFFS = [0.1, 0.0, 0.3, 0.5]  # |train - gen| on the 4 valid tokens


def test_token_mult_prob_error_is_token_weighted():
    expected = sum(math.exp(d) for d in DIFFS) / 4
    got = token_mult_prob_error(TRAIN, GEN, MASK)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, rel=1e-6)  # inputs are float32: ~1e-7 relative
    per_sequence = (sum(math.exp(d) for d in DIFFS[:3]) / 3 + math.exp(0.5)) / 2
    assert abs(got - per_sequence) > 1e-3  # not a mean of per-sequence means


def test_token_mult_prob_error_edge_cases():
    lp = -torch.rand(2, 3)
    assert token_mult_prob_error(lp, lp.clone(), torch.ones(2, 3)) == 1.0
    assert math.isnan(token_mult_prob_error(lp, lp, torch.zeros(2, 3, dtype=torch.bool)))
    bad = lp.clone()
    bad[0, 0] = -INF  # a valid token the trainer gives probability 0: a broken engine, not hidden
    assert token_mult_prob_error(bad, lp, torch.ones(2, 3)) == INF
    with pytest.raises(ValueError, match="must have one shape"):
        token_mult_prob_error(lp, lp[:, :2], torch.ones(2, 3))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_token_mult_prob_error_symmetric_and_at_least_one(seed):
    g = torch.Generator().manual_seed(seed)
    a, b = -torch.rand(3, 4, generator=g) * 3, -torch.rand(3, 4, generator=g) * 3
    m = torch.rand(3, 4, generator=g) < 0.7
    m[0, 0] = True
    x = token_mult_prob_error(a, b, m)
    assert x == token_mult_prob_error(b, a, m) and x >= 1.0


def test_mismatch_stats():
    s = mismatch_stats(TRAIN, GEN, MASK)
    signed = [0.1, 0.0, -0.3, 0.5]  # train - gen
    assert s["token_mult_prob_error"] == pytest.approx(token_mult_prob_error(TRAIN, GEN, MASK))
    assert s["logprob_abs_diff_max"] == pytest.approx(0.5, rel=1e-6)
    assert s["gen_kl"] == pytest.approx(sum(math.exp(d) - d - 1 for d in signed) / 4, rel=1e-5)
    assert s["num_valid_tokens"] == 4.0
    empty = mismatch_stats(TRAIN, GEN, torch.zeros_like(MASK))
    assert empty["num_valid_tokens"] == 0.0 and math.isnan(empty["token_mult_prob_error"])


def test_reward_stats():
    r = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    s = reward_stats(r)
    mean = 7 / 12
    assert s["reward_mean"] == pytest.approx(mean)
    assert s["reward_std"] == pytest.approx(math.sqrt(mean * (1 - mean)))  # population std of 0/1 values
    assert s["frac_zero_std_groups"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        reward_stats(torch.ones(3))


def test_masked_entropy():
    logits = torch.zeros(2, 3, 5)
    logits[0, 1] = torch.tensor([0.0, -INF, -INF, -INF, -INF])  # deterministic: H = 0, not NaN
    logits[1, 0] = torch.tensor([math.log(1), math.log(3), -INF, -INF, -INF])  # p = (1/4, 3/4)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    h2 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert masked_entropy(logits, mask) == pytest.approx((math.log(5) + 0.0 + h2) / 3, rel=1e-6)
    assert math.isnan(masked_entropy(logits, torch.zeros_like(mask)))


def test_mismatch_stats_agree_with_the_diagnostics_catalogue():
    from fp8rl_core.diagnostics import step_diagnostics

    train, gen = -torch.rand(3, 5, dtype=torch.float64), -torch.rand(3, 5, dtype=torch.float64)
    mask = torch.rand(3, 5) > 0.3
    mask[0, 0] = True
    s, c = mismatch_stats(train, gen, mask), step_diagnostics(train, gen, mask)
    assert s["token_mult_prob_error"] == c["token_mult_prob_error"] == token_mult_prob_error(train, gen, mask)
    assert s["logprob_abs_diff_max"] == c["logprob_abs_diff_max"]
    assert s["gen_kl"] == pytest.approx(c["gen_kl_error"], rel=1e-12)  # NeMo RL's name for the same k3 mean
    assert s["num_valid_tokens"] == c["num_valid_tokens"]
