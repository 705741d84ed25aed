"""Importance-sampling weights that correct for the generation/training mismatch (pure functions).

The generation engine samples token y_t with log-prob `gen_t`; the training engine scores the same token
under the same weights as `train_t`. Their difference is the mismatch the FP8 recipes create. NeMo RL's
`use_importance_sampling_correction` multiplies the clipped policy-gradient term by

    w_t = exp(train_t - gen_t)       (detached; NaN/inf -> 0)

Variants, chosen by name through a registry (an unknown name lists the supported ones):

| name       | weight on a valid token                                   | reference                      |
| ---------- | --------------------------------------------------------- | ------------------------------ |
| `none`     | 1                                                         | plain GRPO                     |
| `token`    | w_t                                                       | NeMo RL                        |
| `tis`      | min(w_t, cap)                                             | truncated IS (verl, TRL)       |
| `icepop`   | w_t if low <= w_t <= high else 0                          | IcePop (masked IS)             |
| `sequence` | exp(mean_{t valid in seq} (train_t - gen_t)), every token | geometric mean (GSPO-style)    |

Every weight is 0 where the mask is 0. Shapes: B sequences x T tokens.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8rl_core.tracking import M_IS_WEIGHT

ISFn = Callable[[torch.Tensor, torch.Tensor, "ISParams"], "ISWeights"]
IS_VARIANTS: dict[str, ISFn] = {}


def register_is_variant(name: str) -> Callable[[ISFn], ISFn]:
    """Register an IS variant `fn(log_ratio[B, T], mask[B, T] bool, params) -> ISWeights`."""

    def deco(fn: ISFn) -> ISFn:
        if name in IS_VARIANTS:
            raise ValueError(f"importance-sampling variant {name!r} is already registered")
        IS_VARIANTS[name] = fn
        return fn

    return deco


def get_is_variant(name: str) -> ISFn:
    if name not in IS_VARIANTS:
        raise ValueError(f"loss.importance_sampling: unknown variant {name!r}; "
                         f"supported: {', '.join(IS_VARIANTS)}")
    return IS_VARIANTS[name]


@dataclass(frozen=True)
class ISParams:
    cap: float = 2.0  # tis
    low: float = 0.5  # icepop
    high: float = 5.0  # icepop


@dataclass(frozen=True)
class ISWeights:
    """IS weights and what the variant did to them (all [B, T], detached, False/0 off-mask).

    weights:   Float[B, T] the weights to multiply into the policy-gradient term
    raw:       Float[B, T] token-level w_t = exp(train_t - gen_t), non-finite -> 0 (the `token` variant)
    truncated: Bool[B, T]  valid tokens whose weight was capped (tis: w_t > cap)
    masked:    Bool[B, T]  valid tokens whose weight was zeroed (non-finite w_t; icepop: out of range;
               sequence: a non-finite sequence weight)
    mask:      Bool[B, T]  the valid tokens
    """

    weights: torch.Tensor
    raw: torch.Tensor
    truncated: torch.Tensor
    masked: torch.Tensor
    mask: torch.Tensor


def _token_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w, nonfinite): w = exp(log_ratio) on valid tokens, 0 where non-finite or off-mask."""
    w = torch.exp(log_ratio)
    nonfinite = mask & ~torch.isfinite(w)
    w = torch.where(mask & ~nonfinite, w, torch.zeros_like(w))
    return w, nonfinite


@register_is_variant("none")
def _is_none(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams) -> ISWeights:
    raw, _ = _token_weights(log_ratio, mask)
    none = torch.zeros_like(mask)
    return ISWeights(mask.to(raw.dtype), raw, none, none, mask)


@register_is_variant("token")
def _is_token(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams) -> ISWeights:
    raw, nonfinite = _token_weights(log_ratio, mask)
    return ISWeights(raw, raw, torch.zeros_like(mask), nonfinite, mask)


@register_is_variant("tis")
def _is_tis(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams) -> ISWeights:
    raw, nonfinite = _token_weights(log_ratio, mask)
    return ISWeights(raw.clamp(max=p.cap), raw, raw > p.cap, nonfinite, mask)


@register_is_variant("icepop")
def _is_icepop(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams) -> ISWeights:
    raw, nonfinite = _token_weights(log_ratio, mask)
    keep = mask & ~nonfinite & (raw >= p.low) & (raw <= p.high)
    weights = torch.where(keep, raw, torch.zeros_like(raw))
    return ISWeights(weights, raw, torch.zeros_like(mask), mask & ~keep, mask)


@register_is_variant("sequence")
def _is_sequence(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams) -> ISWeights:
    raw, _ = _token_weights(log_ratio, mask)
    zero = torch.zeros_like(log_ratio)
    n = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_w = torch.exp(torch.where(mask, log_ratio, zero).sum(dim=-1, keepdim=True) / n)  # [B, 1]
    bad = mask & ~torch.isfinite(seq_w)  # a NaN/inf token poisons its whole sequence -> 0
    weights = torch.where(mask & ~bad, seq_w.expand_as(log_ratio), zero)
    return ISWeights(weights, raw, torch.zeros_like(mask), bad, mask)


def _check(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    if train_logprobs.dim() != 2:
        raise ValueError(f"train_logprobs must be [B, T], got shape {tuple(train_logprobs.shape)}")
    for name, t in (("gen_logprobs", gen_logprobs), ("mask", mask)):
        if t.shape != train_logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected train_logprobs' "
                             f"{tuple(train_logprobs.shape)}")


def compute_importance(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor,
                       variant: str, cap: float = 2.0, low: float = 0.5, high: float = 5.0) -> ISWeights:
    """IS weights of `variant` plus what it truncated/masked (see the module table).

    train_logprobs: Float[B, T] training engine's log-probs of the sampled tokens (old policy)
    gen_logprobs:   Float[B, T] generation engine's log-probs of the same tokens
    mask:           Bool[B, T] (or 0/1) valid response tokens; values off the mask are never read
    Weights are float32 (float64 if the inputs are), computed without autograd.
    """
    fn = get_is_variant(variant)
    _check(train_logprobs, gen_logprobs, mask)
    if not cap > 0 or not 0 <= low <= high:
        raise ValueError(f"need cap > 0 and 0 <= low <= high, got cap={cap}, low={low}, high={high}")
    with torch.no_grad():
        dtype = torch.promote_types(train_logprobs.dtype, torch.float32)
        m = mask.bool()
        diff = train_logprobs.detach().to(dtype) - gen_logprobs.detach().to(dtype)
        log_ratio = torch.where(m, diff, torch.zeros_like(diff))
        return fn(log_ratio, m, ISParams(cap, low, high))


def importance_weights(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor,
                       variant: str, cap: float = 2.0, low: float = 0.5, high: float = 5.0) -> torch.Tensor:
    """Float[B, T] detached IS weights of `variant` (none|token|tis|icepop|sequence), 0 off-mask."""
    return compute_importance(train_logprobs, gen_logprobs, mask, variant, cap, low, high).weights


def importance_stats(isw: ISWeights) -> dict[str, float]:
    """Per-step IS metrics over the valid tokens (0.0 each when there are none).

    is_weight_mean / is_weight_max: of the weights used; is_raw_weight_mean / is_raw_weight_max: of the
    token-level w_t (the mismatch as IS sees it, also with `none`); is_fraction_truncated /
    is_fraction_masked: fraction of valid tokens capped / zeroed by the variant.
    """
    m = isw.mask
    n = int(m.sum())
    if n == 0:
        return dict.fromkeys((M_IS_WEIGHT, "is_weight_max", "is_raw_weight_mean", "is_raw_weight_max",
                              "is_fraction_truncated", "is_fraction_masked"), 0.0)
    w, raw = isw.weights.double()[m], isw.raw.double()[m]
    return {
        M_IS_WEIGHT: float(w.mean()),
        "is_weight_max": float(w.max()),
        "is_raw_weight_mean": float(raw.mean()),
        "is_raw_weight_max": float(raw.max()),
        "is_fraction_truncated": float((isw.truncated & m).sum()) / n,
        "is_fraction_masked": float((isw.masked & m).sum()) / n,
    }


def importance_weights_with_stats(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor,
                                  mask: torch.Tensor, variant: str, cap: float = 2.0, low: float = 0.5,
                                  high: float = 5.0) -> tuple[torch.Tensor, dict[str, float]]:
    """(weights Float[B, T], importance_stats): what a training step needs in one call."""
    isw = compute_importance(train_logprobs, gen_logprobs, mask, variant, cap, low, high)
    return isw.weights, importance_stats(isw)
