"""The study's mismatch metric, a pure function of tensors (Figure 1's `token_mult_prob_error`).

How far the training engine's log-probs of the sampled tokens (same weights, before the update) are
from what the generation engine reported. Shapes: B sequences x T tokens.
Every other framework's mismatch metric (NeMo RL, verl, TRL), computed in one pass per step, is in
fp8rl_core/diagnostics/catalogue.py; this one agrees with it bit for bit.
"""
from __future__ import annotations

import math

import torch


def _valid_diff(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Float64[n]: train - gen on the valid tokens (flattened)."""
    if train_logprobs.shape != gen_logprobs.shape or train_logprobs.shape != mask.shape:
        raise ValueError(f"train_logprobs {tuple(train_logprobs.shape)}, gen_logprobs "
                         f"{tuple(gen_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape")
    m = mask.bool()
    return train_logprobs.detach().double()[m] - gen_logprobs.detach().double()[m]


def mult_prob_error_terms(abs_d: torch.Tensor) -> torch.Tensor:
    """exp(|d|) per token, d = train - gen: the terms token_mult_prob_error averages (NeMo RL's
    definition). The one place the formula lives: the step's all-ranks sum and the diagnostics
    catalogue use it too, so every report of the metric is the same bits."""
    return torch.exp(abs_d)


def k2_terms(d: torch.Tensor) -> torch.Tensor:
    """½ d² per token, d = log π_train − log π_gen: the k2 estimate of the KL between the two engines'
    policies (Schulman 2020), prime-rl's squared log-ratio "KL to the rollout policy" (its loss adds
    kl_tau · d², i.e. 2·kl_tau times this; src/prime_rl/trainer/rl/loss.py `default_loss_fn`). The one
    place the formula lives: the loss term (grpo.rollout_kl) and the catalogue's rollout_k2_kl use it."""
    return 0.5 * d * d


def token_mult_prob_error_sum(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor,
                              mask: torch.Tensor) -> tuple[float, int]:
    """(sum_i exp(|train_i - gen_i|), n) over the n valid tokens, in float64: what ranks all-reduce
    before dividing (the metric is token-weighted over the global batch). Shapes as below."""
    d = _valid_diff(train_logprobs, gen_logprobs, mask)
    return float(mult_prob_error_terms(d.abs()).sum()), d.numel()


def token_mult_prob_error(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor,
                          mask: torch.Tensor) -> float:
    """(1/n) sum_i exp(|train_i - gen_i|) over the n valid tokens of the batch (token-weighted).

    train_logprobs, gen_logprobs: Float[B, T]; mask: Bool[B, T] (or 0/1), the valid response tokens (up to
    and including EOS; no prompt or padding). 1.0 is a perfect match; 1.03-1.05 is the usual "acceptable"
    bound. Computed in float64. Returns nan when no token is valid (no data, not a perfect match); a
    non-finite log-prob on a valid token gives inf/nan, on purpose: it is a broken engine.
    """
    total, n = token_mult_prob_error_sum(train_logprobs, gen_logprobs, mask)
    # sum / n (not .mean()): the same float64 operations as the diagnostics catalogue, so both report
    # the same bits (fp8rl_core/diagnostics/catalogue.py lists the other frameworks' metrics)
    return total / n if n else math.nan


def sequence_mult_prob_error(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor,
                             mask: torch.Tensor) -> torch.Tensor:
    """Float64[B]: each sequence's own token_mult_prob_error, e_b = (1/n_b) sum_{t: mask[b, t]} exp(|train - gen|).

    Shapes as token_mult_prob_error's (train_logprobs, gen_logprobs, mask all [B, T]); n_b is row b's count
    of valid tokens. nan where n_b = 0 (no data); inf/nan where a valid token's log-prob is non-finite. What
    the mismatch guard's `mask` action compares per sequence (fp8rl_core/engines/guard.py).
    """
    if train_logprobs.shape != gen_logprobs.shape or train_logprobs.shape != mask.shape or mask.dim() != 2:
        raise ValueError(f"train_logprobs {tuple(train_logprobs.shape)}, gen_logprobs "
                         f"{tuple(gen_logprobs.shape)} and mask {tuple(mask.shape)} must have one [B, T] shape")
    m = mask.bool()
    d = train_logprobs.detach().double() - gen_logprobs.detach().double()
    # zero off the mask before exp: a NaN there (padding) must not reach the row's sum
    terms = torch.where(m, mult_prob_error_terms(torch.where(m, d, torch.zeros_like(d)).abs()), torch.zeros_like(d))
    n = m.sum(dim=-1)
    return torch.where(n > 0, terms.sum(dim=-1) / n.clamp(min=1), torch.full_like(terms[:, 0], math.nan))
