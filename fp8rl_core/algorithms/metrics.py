"""Per-step metrics of a GRPO run that are pure functions of tensors (the loop adds timings).

The study's Figure 1 is `token_mult_prob_error`: how far the training engine's log-probs of the sampled
tokens (same weights, before the update) are from what the generation engine reported.
Shapes: B sequences x T tokens; P prompts x G samples; V vocabulary.
Every other framework's mismatch metric (NeMo RL, verl, TRL), computed in one pass per step, is in
fp8rl_core/diagnostics/catalogue.py; the functions here agree with it bit for bit where they overlap.
"""
from __future__ import annotations

import math

import torch

from fp8rl_core.algorithms.grpo import k3_kl


def _valid_diff(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Float64[n]: train - gen on the valid tokens (flattened)."""
    if train_logprobs.shape != gen_logprobs.shape or train_logprobs.shape != mask.shape:
        raise ValueError(f"train_logprobs {tuple(train_logprobs.shape)}, gen_logprobs "
                         f"{tuple(gen_logprobs.shape)} and mask {tuple(mask.shape)} must have one shape")
    m = mask.bool()
    return train_logprobs.detach().double()[m] - gen_logprobs.detach().double()[m]


def token_mult_prob_error(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor,
                          mask: torch.Tensor) -> float:
    """(1/n) sum_i exp(|train_i - gen_i|) over the n valid tokens of the batch (token-weighted).

    train_logprobs, gen_logprobs: Float[B, T]; mask: Bool[B, T] (or 0/1), the valid response tokens (up to
    and including EOS; no prompt or padding). 1.0 is a perfect match; 1.03-1.05 is the usual "acceptable"
    bound. Computed in float64. Returns nan when no token is valid (no data, not a perfect match); a
    non-finite log-prob on a valid token gives inf/nan, on purpose: it is a broken engine.
    """
    d = _valid_diff(train_logprobs, gen_logprobs, mask)
    if d.numel() == 0:
        return math.nan
    # sum / n (not .mean()): the same float64 operations as the diagnostics catalogue, so both report
    # the same bits (fp8rl_core/diagnostics/catalogue.py lists the other frameworks' metrics)
    return float(torch.exp(d.abs()).sum()) / d.numel()


def mismatch_stats(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor,
                   mask: torch.Tensor) -> dict[str, float]:
    """Generation/training mismatch metrics over the valid tokens (nan each when none).

    token_mult_prob_error: as above; logprob_abs_diff_max: max |train - gen|;
    gen_kl: mean k3 estimate of KL(pi_gen || pi_train) on the sampled tokens,
    exp(train - gen) - (train - gen) - 1 (NeMo RL's gen_kl_error); num_valid_tokens: n.
    """
    d = _valid_diff(train_logprobs, gen_logprobs, mask)
    n = d.numel()
    if n == 0:
        return {"token_mult_prob_error": math.nan, "logprob_abs_diff_max": math.nan, "gen_kl": math.nan,
                "num_valid_tokens": 0.0}
    return {
        "token_mult_prob_error": float(torch.exp(d.abs()).mean()),
        "logprob_abs_diff_max": float(d.abs().max()),
        "gen_kl": float(k3_kl(torch.zeros_like(d), d, clamp=None).mean()),
        "num_valid_tokens": float(n),
    }


def reward_stats(rewards: torch.Tensor) -> dict[str, float]:
    """rewards: Float[P, G]. reward_mean, reward_std (population, all P*G samples), and
    frac_zero_std_groups: fraction of prompts whose G rewards are all equal (no GRPO signal)."""
    if rewards.dim() != 2 or rewards.numel() == 0:
        raise ValueError(f"rewards must be a non-empty [P, G] tensor, got shape {tuple(rewards.shape)}")
    r = rewards.detach().double()
    flat_groups = (r == r[:, :1]).all(dim=1)
    return {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std(correction=0)),
        "frac_zero_std_groups": float(flat_groups.double().mean()),
    }


def masked_entropy(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean entropy (nats) of the next-token distributions at the valid positions.

    logits: Float[B, T, V] (already temperature-scaled when the sampling distribution is meant);
    mask: Bool[B, T]. H_t = -sum_v p_v log p_v. Returns nan when no position is valid.
    """
    if logits.dim() != 3 or logits.shape[:2] != mask.shape:
        raise ValueError(f"logits must be [B, T, V] matching mask [B, T]; got {tuple(logits.shape)} "
                         f"and {tuple(mask.shape)}")
    m = mask.bool()
    if not m.any():
        return math.nan
    with torch.no_grad():
        p = torch.softmax(logits.detach()[m].float(), dim=-1)  # [n, V]
        ent = -torch.special.xlogy(p, p).sum(dim=-1)  # xlogy: 0 log 0 = 0 (masked-out vocab entries)
    return float(ent.double().mean())
