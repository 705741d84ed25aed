"""The per-sequence mismatch the guard's `mask` action compares: each row's own token_mult_prob_error."""
from __future__ import annotations

import math

import pytest
import torch

from fp8rl_core.algorithms.metrics import sequence_mult_prob_error, token_mult_prob_error

NAN, INF = float("nan"), float("inf")
# row 0: 3 valid tokens, row 1: 1, row 2: none; off-mask entries are junk that must be ignored
TRAIN = torch.tensor([[-1.0, -2.0, -0.5, NAN], [-0.1, INF, 0.0, 0.0], [NAN, 1.0, 2.0, 3.0]])
GEN = torch.tensor([[-1.1, -2.0, -0.2, 0.0], [-0.6, 0.0, -INF, 0.0], [0.0, 0.0, 0.0, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, False, False, False], [False] * 4])


def test_each_row_is_its_own_token_mean():
    got = sequence_mult_prob_error(TRAIN, GEN, MASK)
    assert got.dtype == torch.float64 and got.shape == (3,)
    # |train - gen| on the valid tokens, by hand: row 0 {0.1, 0, 0.3}, row 1 {0.5}; float32 inputs (~1e-7)
    assert float(got[0]) == pytest.approx((math.exp(0.1) + 1 + math.exp(0.3)) / 3, rel=1e-6)
    assert float(got[1]) == pytest.approx(math.exp(0.5), rel=1e-6)
    assert math.isnan(float(got[2]))  # no data, not a perfect match
    # a row alone is the batch metric of that row
    for b in (0, 1):
        assert float(got[b]) == pytest.approx(token_mult_prob_error(TRAIN[b:b + 1], GEN[b:b + 1], MASK[b:b + 1]),
                                              rel=1e-12)


def test_a_non_finite_valid_token_poisons_only_its_row():
    train = TRAIN.clone()
    train[1, 0] = -INF
    got = sequence_mult_prob_error(train, GEN, MASK)
    assert float(got[1]) == INF and math.isfinite(float(got[0]))
    with pytest.raises(ValueError, match=r"one \[B, T\] shape"):
        sequence_mult_prob_error(TRAIN, GEN[:, :2], MASK)
