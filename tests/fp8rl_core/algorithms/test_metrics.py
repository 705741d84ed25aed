"""The mismatch metric against hand-computed float64 values."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl_core.algorithms.metrics import token_mult_prob_error

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
