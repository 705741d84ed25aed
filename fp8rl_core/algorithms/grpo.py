"""GRPO as NeMo RL runs it: leave-one-out group advantages and the clipped, IS-corrected token loss.

Pure tensor functions. Shapes: P prompts x G samples per prompt; B sequences x T tokens.
The IS weights live in fp8rl_core/algorithms/importance.py and are re-exported here.
"""
from __future__ import annotations

import torch

from fp8rl_core.algorithms.importance import (  # re-exported: fp8rl_core.algorithms.grpo is the public home
    IS_VARIANTS,
    NEEDS_ADVANTAGES,
    ISWeights,
    compute_importance,
    importance_from_config,
    importance_stats,
    importance_weights,
    importance_weights_with_stats,
    register_is_variant,
)
from fp8rl_core.algorithms.metrics import k2_terms
from fp8rl_core.tracking import M_LOSS

__all__ = ["ADV_EPS", "IS_VARIANTS", "ISWeights", "NEEDS_ADVANTAGES", "compute_importance", "group_advantages",
           "importance_from_config", "importance_stats", "importance_weights", "importance_weights_with_stats", "k3_kl",
           "masked_mean", "policy_loss", "register_is_variant", "rollout_kl"]

ADV_EPS = 1e-6
# A leave-one-out std at or below this fraction of the group's reward scale is float64 rounding noise
# of an all-equal group (e.g. mean(0.1, 0.1, 0.1) != 0.1); dividing by it would blow A up by 1e6.
_STD_REL_TOL = 1e-9


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out GRPO advantages (NeMo RL's estimator).

    For sample i of a group of G:  b_i = mean_{j!=i} r_j,
    s_i = sqrt(mean_{j!=i} r_j^2 - b_i^2)   (the leave-one-out population std),
    A_i = (r_i - b_i) / (s_i + 1e-6) where s_i > 0, else A_i = r_i - b_i.   G = 1 gives A = 0.

    rewards: Float[P, G] (finite). Returns Float[P, G] in rewards' float dtype (float32 for ints),
    computed in float64. The variance is taken as mean_{j!=i} (r_j - b_i)^2, the same quantity without
    the cancellation of the textbook form.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P prompts, G samples], got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN/inf; a reward function must return finite numbers")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    P, G = rewards.shape
    if G == 1:
        return torch.zeros(P, G, dtype=out_dtype, device=rewards.device)
    r = rewards.detach().double()
    baseline = (r.sum(dim=1, keepdim=True) - r) / (G - 1)  # [P, G]
    others = ~torch.eye(G, dtype=torch.bool, device=r.device)  # [G(i), G(j)]: j != i
    dev = r.unsqueeze(1) - baseline.unsqueeze(2)  # [P, G(i), G(j)] = r_j - b_i
    var = (dev.square() * others).sum(dim=2) / (G - 1)
    std = var.clamp(min=0).sqrt()
    scale = r.abs().amax(dim=1, keepdim=True)
    centered = r - baseline
    adv = torch.where(std > _STD_REL_TOL * scale, centered / (std + ADV_EPS), centered)
    return adv.to(out_dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(x * mask) / max(sum(mask), 1) over `dim` (all dims when None).

    Values of x off the mask are never read (NaN/inf there neither leak nor poison gradients).
    An empty mask gives 0.
    """
    m = mask.bool()
    xm = torch.where(m, x, torch.zeros_like(x))
    if dim is None:
        return xm.sum() / m.sum().clamp(min=1)
    return xm.sum(dim=dim) / m.sum(dim=dim).clamp(min=1)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, clamp: float | None = 10.0) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) on tokens sampled from pi (Schulman 2020).

    d = clamp(ref - logp, -clamp, clamp);  k3 = exp(d) - d - 1  (>= 0; unbiased, low variance).
    logprobs, ref_logprobs: Float[B, T]. Returns Float[B, T]; gradients flow through logprobs only
    (and not where the clamp is active).
    """
    d = ref_logprobs.detach() - logprobs
    if clamp is not None:
        d = d.clamp(-clamp, clamp)
    return torch.expm1(d) - d  # = exp(d) - d - 1 without the cancellation that makes it < 0 near d = 0


def rollout_kl(logprobs: torch.Tensor, gen_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token squared log-ratio KL to the rollout (generation) policy: ½ (logp_t − gen_t)².

    prime-rl's `kl_loss = log_importance_ratio**2` (src/prime_rl/trainer/rl/loss.py `default_loss_fn`,
    coefficient kl_tau = 1e-3), with the ½ of the k2 estimator: prime-rl's kl_tau τ is rollout_kl_coef 2τ.
    logprobs, gen_logprobs: Float[B, T]. Returns Float[B, T]; gradients flow through logprobs only
    (d/dlogp = logp − gen: it pulls the trainer's policy toward what generated the tokens).
    """
    return k2_terms(logprobs - gen_logprobs.detach())


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, is_weights: torch.Tensor | None = None, *, clip_low: float = 0.2,
                clip_high: float = 0.2, ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0,
                kl_clamp: float = 10.0, num_tokens: float | None = None,
                gen_logprobs: torch.Tensor | None = None, rollout_kl_coef: float = 0.0,
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """L = (1/n) sum_{t valid} [ w_t * max(-A_t r_t, -A_t clip(r_t, 1-clip_low, 1+clip_high))
                                 + kl_coef * k3(ref_t - logp_t) + rollout_kl_coef * ½ (logp_t - gen_t)² ]

    with r_t = exp(logp_t - old_t), w_t the (detached) IS weight (NeMo RL: it multiplies the clipped
    policy-gradient term, not the KL), k3 the clamped k3 KL to the reference policy, and n the number of
    valid tokens of this batch (token-level aggregation) or `num_tokens` when given (the global count,
    for gradient accumulation over micro-batches).

    logprobs:     Float[B, T] current policy log-probs of the sampled tokens (requires grad)
    old_logprobs: Float[B, T] log-probs under the policy that the ratio is taken against
    advantages:   Float[B, T], or Float[B] broadcast over tokens
    mask:         Bool[B, T] (or 0/1) valid response tokens; nothing off the mask is read
    is_weights:   Float[B, T] or None (= 1)
    ref_logprobs: Float[B, T] or None; with it, `kl` is reported even when kl_coef is 0
    gen_logprobs: Float[B, T] or None: the generation engine's log-probs; with it, `rollout_kl` (mean
                  ½ (logp - gen)², rollout_kl above, without the coefficient) is reported, and
                  rollout_kl_coef > 0 needs it (prime-rl's squared log-ratio term; 0: off)
    Returns (loss scalar, metrics): loss, pg_loss, kl (mean k3, without the coefficient), clip_fraction
    (valid tokens whose clipped term is the active one, i.e. zero gradient), ratio_mean, ratio_max.
    With `num_tokens`, loss/pg_loss/kl are this micro-batch's share of the global mean (they add up).
    With no valid tokens the loss is a graph-connected 0 and every metric is 0.0.
    """
    advantages = _check_loss_inputs(logprobs, old_logprobs, advantages, mask, is_weights, ref_logprobs,
                                    kl_coef, num_tokens, gen_logprobs, rollout_kl_coef)
    m = mask.bool()
    zero = torch.zeros_like(logprobs)

    def valid(t: torch.Tensor) -> torch.Tensor:
        # Zero everything off the mask first: a NaN there would otherwise reach the gradient as 0 * NaN.
        return torch.where(m, t.to(logprobs.dtype), zero)

    lp = valid(logprobs)
    adv = valid(advantages.detach())
    ratio = torch.exp(lp - valid(old_logprobs.detach()))
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_unclipped, pg_clipped = -adv * ratio, -adv * clipped
    pg = torch.maximum(pg_unclipped, pg_clipped)  # = -min(r A, clip(r) A): the pessimistic bound
    if is_weights is not None:
        pg = pg * valid(is_weights.detach())
    n_valid = int(m.sum())
    denom = float(num_tokens) if num_tokens is not None else max(n_valid, 1)
    pg_loss = valid(pg).sum() / denom
    kl = zero.sum()
    if ref_logprobs is not None:
        kl = valid(k3_kl(lp, valid(ref_logprobs.detach()), kl_clamp)).sum() / denom
    loss = pg_loss + kl_coef * kl if kl_coef else pg_loss
    if gen_logprobs is not None:
        rkl = valid(rollout_kl(lp, valid(gen_logprobs.detach()))).sum() / denom
        loss = loss + rollout_kl_coef * rkl if rollout_kl_coef else loss
    with torch.no_grad():
        active = m & (pg_clipped > pg_unclipped)  # the clipped branch is the max: zero gradient there
        metrics = {
            M_LOSS: float(loss),
            "pg_loss": float(pg_loss),
            "kl": float(kl),
            "clip_fraction": float(active.sum()) / n_valid if n_valid else 0.0,
            "ratio_mean": float(masked_mean(ratio, m)),
            "ratio_max": float(ratio[m].max()) if n_valid else 0.0,
        }
        if gen_logprobs is not None:
            metrics["rollout_kl"] = float(rkl)
    return loss, metrics


def _check_loss_inputs(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, is_weights: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
                       kl_coef: float, num_tokens: float | None, gen_logprobs: torch.Tensor | None = None,
                       rollout_kl_coef: float = 0.0) -> torch.Tensor:
    """Validate policy_loss's inputs; returns advantages as [B, T]."""
    if logprobs.dim() != 2 or logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, old_logprobs {tuple(old_logprobs.shape)} and "
                         f"mask {tuple(mask.shape)} must have the same [B, T] shape")
    if advantages.dim() == 1 and advantages.shape[0] == logprobs.shape[0]:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    for name, t in (("advantages", advantages), ("is_weights", is_weights), ("ref_logprobs", ref_logprobs),
                    ("gen_logprobs", gen_logprobs)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(logprobs.shape)}")
    if kl_coef and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (the reference policy's log-probs)")
    if rollout_kl_coef and gen_logprobs is None:
        raise ValueError(f"rollout_kl_coef={rollout_kl_coef} needs gen_logprobs (the generation engine's log-probs)")
    if num_tokens is not None and not num_tokens > 0:
        raise ValueError(f"num_tokens must be > 0 (the global count of valid tokens), got {num_tokens}")
    return advantages
