"""The sampler: empirical frequencies vs the intended distributions (computed here in float64 from the
definitions), log-probs vs log_softmax(logits / T), filters, determinism."""
from __future__ import annotations

import pytest
import torch

from fp8rl_core.engines.base import SamplingParams
from fp8rl_core.engines.sampling import filter_top_k_top_p, sample_next, validate_sampling

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0, -3.0, 0.25])
N = 40_000  # rows: one draw each; a frequency's std is <= 0.0025


def draw(sp: SamplingParams, logits: torch.Tensor = LOGITS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return sample_next(logits.expand(N, -1), sp, torch.Generator().manual_seed(seed))


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def target(logits: torch.Tensor, temperature: float, keep: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(logits / T) restricted to `keep` and renormalised, float64."""
    z = logits.double() / temperature
    if keep is not None:
        z = z.masked_fill(~keep, float("-inf"))
    return torch.softmax(z, -1)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_frequencies_follow_tempered_softmax(temperature):
    tokens, logp = draw(SamplingParams(max_new_tokens=1, temperature=temperature))
    assert (frequencies(tokens, 8) - target(LOGITS, temperature)).abs().max() < 0.012  # ~5 sigma
    expect = torch.log_softmax(LOGITS.double() / temperature, -1)[tokens]
    torch.testing.assert_close(logp.double(), expect, rtol=0, atol=1e-6)


def test_top_k_renormalises_over_the_k_best_and_reports_unfiltered_logprobs():
    tokens, logp = draw(SamplingParams(max_new_tokens=1, top_k=3, temperature=0.8))
    keep = torch.zeros(8, dtype=torch.bool)
    keep[:3] = True  # LOGITS' three largest are indices 0, 1, 2
    assert (frequencies(tokens, 8) - target(LOGITS, 0.8, keep)).abs().max() < 0.012
    torch.testing.assert_close(logp.double(), torch.log_softmax(LOGITS.double() / 0.8, -1)[tokens], rtol=0, atol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    p = target(LOGITS, 1.0)
    order = p.argsort(descending=True)
    mass_before = p[order].cumsum(0) - p[order]
    keep = torch.zeros(8, dtype=torch.bool)
    keep[order[mass_before < 0.7]] = True  # from the definition, float64
    tokens, _ = draw(SamplingParams(max_new_tokens=1, top_p=0.7))
    assert (frequencies(tokens, 8) - target(LOGITS, 1.0, keep)).abs().max() < 0.012
    assert 1 < int(keep.sum()) < 8  # the case is not trivial


def test_degenerate_filters_and_greedy_pick_the_argmax():
    for sp in (SamplingParams(max_new_tokens=1, top_k=1), SamplingParams(max_new_tokens=1, top_p=1e-9),
               SamplingParams(max_new_tokens=1, greedy=True, temperature=0.3)):
        tokens, logp = draw(sp)
        assert (tokens == 0).all(), sp
    torch.testing.assert_close(logp, torch.log_softmax(LOGITS, -1)[0].expand(N))  # greedy: T = 1


def test_filter_leaves_rows_independent():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    out = filter_top_k_top_p(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(out).sum(-1).tolist() == [2, 2]
    assert torch.isfinite(out[0, :2]).all() and torch.isfinite(out[1, -2:]).all()


def test_same_seed_same_draws():
    a, _ = draw(SamplingParams(max_new_tokens=1), seed=3)
    b, _ = draw(SamplingParams(max_new_tokens=1), seed=3)
    c, _ = draw(SamplingParams(max_new_tokens=1), seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_zero_probability_tokens_are_never_drawn():
    logits = torch.tensor([0.0, float("-inf"), 0.0, float("-inf")])
    tokens, logp = draw(SamplingParams(max_new_tokens=1), logits)
    assert set(tokens.tolist()) == {0, 2} and torch.isfinite(logp).all()


@pytest.mark.parametrize("bad,field", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=0.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
])
def test_invalid_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        validate_sampling(SamplingParams(**{"max_new_tokens": 4, **bad}))
