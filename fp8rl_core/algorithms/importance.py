"""Importance-sampling weights that correct for the generation/training mismatch (pure functions).

The generation engine samples token y_t with log-prob `gen_t`; the training engine scores the same token
under the same weights as `train_t`. Their difference is the mismatch the FP8 recipes create. NeMo RL's
`use_importance_sampling_correction` multiplies the clipped policy-gradient term by

    w_t = exp(train_t - gen_t)       (detached; NaN/inf -> 0)

Variants, chosen by name through a registry (an unknown name lists the supported ones):

| name       | weight on a valid token                                    | reference                      |
| ---------- | ---------------------------------------------------------- | ------------------------------ |
| `none`     | 1                                                          | plain GRPO                     |
| `token`    | w_t                                                        | NeMo RL                        |
| `tis`      | min(w_t, cap)                                              | truncated IS (verl, TRL)       |
| `icepop`   | w_t if low <= w_t <= high else 0                           | IcePop (masked IS)             |
| `sequence` | exp(mean_{t valid in seq} (train_t - gen_t)), every token  | geometric mean (GSPO-style)    |
| `seq_mask` | s_b = exp(sum_{t valid in seq} (train_t - gen_t)) on every | TRL `sequence_mask` (MIS)      |
|            | token of b if seq_low <= s_b <= seq_high, else 0           |                                |
| `dppo`     | w_t, or 0 where p_t - q_t > prob_high (A_t > 0) /          | prime-rl default loss (DPPO    |
|            | p_t - q_t < -prob_low (A_t <= 0); p = e^train, q = e^gen   | trust-region mask)             |

Every weight is 0 where the mask is 0. Shapes: B sequences x T tokens. `dppo` reads the advantages
(`compute_importance(..., advantages=[B] or [B, T])`); a variant in NEEDS_ADVANTAGES refuses to run
without them.

Peers' definitions:
- `seq_mask`: TRL trl/trainer/grpo_trainer.py (`vllm_importance_sampling_mode="sequence_mask"`, the
  default, with trl/trainer/grpo_config.py `vllm_importance_sampling_clip_max=3.0`, `clip_min=None`):
  the sequence ratio is the PRODUCT of the token ratios, exp(sum of the masked log-ratio differences), not
  the geometric mean of `sequence`; a sequence whose ratio is outside [C_min, C_max] gets weight 0, a kept
  one its ratio. TRL's C_min=None (no lower bound) is seq_low = 0 here (a ratio is never below 0).
- `dppo`: prime-rl src/prime_rl/trainer/rl/loss.py `default_loss_fn` (DPPO-Binary TV, thresholds
  `dppo_mask_low` = `dppo_mask_high` = 0.2 in packages/prime-rl-configs/src/prime_rl/configs/trainer.py
  `DefaultLossConfig`): probs_diff = exp(trainer) - exp(inference); a token with a positive advantage is
  masked when probs_diff > high, every other token (advantage <= 0: prime-rl's `torch.where(A > 0, ...)`)
  when probs_diff < -low. prime-rl's policy-gradient term keep_mask * A * exp(trainer - inference) carries
  the token ratio w_t on kept tokens, so the weight here is w_t where kept, 0 where masked. prime-rl
  applies the mask with the current policy's log-probs (one optimizer step per batch); here, as every IS
  variant, with the old (pre-update) training log-probs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fp8rl_core.tracking import M_IS_WEIGHT

ISFn = Callable[[torch.Tensor, torch.Tensor, "ISParams", "ISInputs"], "ISWeights"]
IS_VARIANTS: dict[str, ISFn] = {}
NEEDS_ADVANTAGES: set[str] = set()  # variants that read ISInputs.advantages


def register_is_variant(name: str, needs_advantages: bool = False) -> Callable[[ISFn], ISFn]:
    """Register an IS variant `fn(log_ratio[B, T], mask[B, T] bool, params, inputs) -> ISWeights`
    (needs_advantages: compute_importance refuses to call it without advantages)."""

    def deco(fn: ISFn) -> ISFn:
        if name in IS_VARIANTS:
            raise ValueError(f"importance-sampling variant {name!r} is already registered")
        IS_VARIANTS[name] = fn
        if needs_advantages:
            NEEDS_ADVANTAGES.add(name)
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
    seq_low: float = 0.0  # seq_mask: keep sequences with seq_low <= s_b <= seq_high (TRL: C_min None)
    seq_high: float = 3.0  # seq_mask (TRL: vllm_importance_sampling_clip_max)
    prob_low: float = 0.2  # dppo: mask A <= 0 tokens with p - q < -prob_low (prime-rl: dppo_mask_low)
    prob_high: float = 0.2  # dppo: mask A > 0 tokens with p - q > prob_high (prime-rl: dppo_mask_high)


@dataclass(frozen=True)
class ISInputs:
    """What a variant may read beyond the log-ratio (all detached, 0 off-mask, the weights' dtype).

    train:      Float[B, T] training engine's log-probs (old policy)
    gen:        Float[B, T] generation engine's log-probs
    advantages: Float[B, T] or None (not given; a NEEDS_ADVANTAGES variant never sees None)
    """

    train: torch.Tensor
    gen: torch.Tensor
    advantages: torch.Tensor | None = None


@dataclass(frozen=True)
class ISWeights:
    """IS weights and what the variant did to them (all [B, T], detached, False/0 off-mask).

    weights:   Float[B, T] the weights to multiply into the policy-gradient term
    raw:       Float[B, T] token-level w_t = exp(train_t - gen_t), non-finite -> 0 (the `token` variant)
    truncated: Bool[B, T]  valid tokens whose weight was capped (tis: w_t > cap)
    masked:    Bool[B, T]  valid tokens whose weight was zeroed (non-finite w_t; icepop: out of range;
               sequence: a non-finite sequence weight; seq_mask: the sequence's ratio out of range or
               non-finite; dppo: the probability-difference mask)
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
def _is_none(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams, x: ISInputs) -> ISWeights:
    raw, _ = _token_weights(log_ratio, mask)
    none = torch.zeros_like(mask)
    return ISWeights(mask.to(raw.dtype), raw, none, none, mask)


@register_is_variant("token")
def _is_token(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams, x: ISInputs) -> ISWeights:
    raw, nonfinite = _token_weights(log_ratio, mask)
    return ISWeights(raw, raw, torch.zeros_like(mask), nonfinite, mask)


@register_is_variant("tis")
def _is_tis(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams, x: ISInputs) -> ISWeights:
    raw, nonfinite = _token_weights(log_ratio, mask)
    return ISWeights(raw.clamp(max=p.cap), raw, raw > p.cap, nonfinite, mask)


@register_is_variant("icepop")
def _is_icepop(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams, x: ISInputs) -> ISWeights:
    raw, nonfinite = _token_weights(log_ratio, mask)
    keep = mask & ~nonfinite & (raw >= p.low) & (raw <= p.high)
    weights = torch.where(keep, raw, torch.zeros_like(raw))
    return ISWeights(weights, raw, torch.zeros_like(mask), mask & ~keep, mask)


@register_is_variant("sequence")
def _is_sequence(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams, x: ISInputs) -> ISWeights:
    raw, _ = _token_weights(log_ratio, mask)
    zero = torch.zeros_like(log_ratio)
    n = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    seq_w = torch.exp(torch.where(mask, log_ratio, zero).sum(dim=-1, keepdim=True) / n)  # [B, 1]
    bad = mask & ~torch.isfinite(seq_w)  # a NaN/inf token poisons its whole sequence -> 0
    weights = torch.where(mask & ~bad, seq_w.expand_as(log_ratio), zero)
    return ISWeights(weights, raw, torch.zeros_like(mask), bad, mask)


@register_is_variant("seq_mask")
def _is_seq_mask(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams, x: ISInputs) -> ISWeights:
    """TRL's sequence-level masked IS: s_b = prod_t w_t = exp(sum_t d_t) over b's valid tokens."""
    raw, _ = _token_weights(log_ratio, mask)
    zero = torch.zeros_like(log_ratio)
    seq_w = sequence_ratio(log_ratio, mask).unsqueeze(-1)  # [B, 1]
    keep = mask & torch.isfinite(seq_w) & (seq_w >= p.seq_low) & (seq_w <= p.seq_high)
    weights = torch.where(keep, seq_w.expand_as(log_ratio), zero)
    return ISWeights(weights, raw, torch.zeros_like(mask), mask & ~keep, mask)


@register_is_variant("dppo", needs_advantages=True)
def _is_dppo(log_ratio: torch.Tensor, mask: torch.Tensor, p: ISParams, x: ISInputs) -> ISWeights:
    """prime-rl's advantage-conditioned probability-difference mask (DPPO), on w_t."""
    raw, nonfinite = _token_weights(log_ratio, mask)
    masked = mask & (nonfinite | dppo_mask(x.train, x.gen, x.advantages, p.prob_low, p.prob_high))
    weights = torch.where(masked, torch.zeros_like(raw), raw)
    return ISWeights(weights, raw, torch.zeros_like(mask), masked, mask)


def sequence_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Float[B]: s_b = exp(sum_{t: mask[b, t]} log_ratio[b, t]), the product of b's token ratios (TRL's
    sequence-level IS ratio). log_ratio, mask: [B, T]; entries off the mask are never read; inf/nan where
    the sum is (a row without valid tokens: 1)."""
    return torch.exp(torch.where(mask, log_ratio, torch.zeros_like(log_ratio)).sum(dim=-1))


def dppo_mask(train: torch.Tensor, gen: torch.Tensor, advantages: torch.Tensor, low: float,
              high: float) -> torch.Tensor:
    """Bool[B, T]: prime-rl's trust-region mask (src/prime_rl/trainer/rl/loss.py `default_loss_fn`).

    With Δp_t = exp(train_t) - exp(gen_t) (probabilities, not log-probs):
        masked_t = Δp_t > high     where A_t > 0   (the probability already rose too far to push it up)
                 = Δp_t < -low     where A_t <= 0  (it already fell too far to push it down)
    train, gen, advantages: Float[B, T] (advantages of a sequence broadcast over its tokens). A NaN
    Δp fails both comparisons (not masked here; the IS variant zeroes its non-finite w_t).
    """
    dp = torch.exp(train) - torch.exp(gen)
    return torch.where(advantages > 0, dp > high, dp < -low)


def _check(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor,
           advantages: torch.Tensor | None) -> None:
    if train_logprobs.dim() != 2:
        raise ValueError(f"train_logprobs must be [B, T], got shape {tuple(train_logprobs.shape)}")
    for name, t in (("gen_logprobs", gen_logprobs), ("mask", mask)):
        if t.shape != train_logprobs.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected train_logprobs' "
                             f"{tuple(train_logprobs.shape)}")
    if advantages is not None and advantages.shape not in (train_logprobs.shape, train_logprobs.shape[:1]):
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected [B] or [B, T] with "
                         f"[B, T] = {tuple(train_logprobs.shape)}")


def compute_importance(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor,
                       variant: str, cap: float = 2.0, low: float = 0.5, high: float = 5.0, *,
                       seq_low: float = 0.0, seq_high: float = 3.0, prob_low: float = 0.2, prob_high: float = 0.2,
                       advantages: torch.Tensor | None = None) -> ISWeights:
    """IS weights of `variant` plus what it truncated/masked (see the module table).

    train_logprobs: Float[B, T] training engine's log-probs of the sampled tokens (old policy)
    gen_logprobs:   Float[B, T] generation engine's log-probs of the same tokens
    mask:           Bool[B, T] (or 0/1) valid response tokens; values off the mask are never read
    advantages:     Float[B] (one per sequence) or Float[B, T], or None; read by the NEEDS_ADVANTAGES
                    variants (`dppo`) only, which refuse to run without them
    Weights are float32 (float64 if the inputs are), computed without autograd.
    """
    fn = get_is_variant(variant)
    _check(train_logprobs, gen_logprobs, mask, advantages)
    if not cap > 0 or not 0 <= low <= high:
        raise ValueError(f"need cap > 0 and 0 <= low <= high, got cap={cap}, low={low}, high={high}")
    if not 0 <= seq_low <= seq_high or not (prob_low >= 0 and prob_high >= 0):
        raise ValueError(f"need 0 <= seq_low <= seq_high and prob_low, prob_high >= 0, got seq_low={seq_low}, "
                         f"seq_high={seq_high}, prob_low={prob_low}, prob_high={prob_high}")
    if variant in NEEDS_ADVANTAGES and advantages is None:
        raise ValueError(f"loss.importance_sampling={variant!r} masks by the sign of each token's advantage: "
                         "pass compute_importance(..., advantages=[B] or [B, T]) (the run loop passes the "
                         "batch's advantages)")
    with torch.no_grad():
        dtype = torch.promote_types(train_logprobs.dtype, torch.float32)
        m = mask.bool()
        zero = torch.zeros(train_logprobs.shape, dtype=dtype, device=train_logprobs.device)
        train = torch.where(m, train_logprobs.detach().to(dtype), zero)
        gen = torch.where(m, gen_logprobs.detach().to(train.device, dtype), zero)
        log_ratio = torch.where(m, train - gen, zero)
        adv = None
        if advantages is not None:
            a = advantages.detach().to(train.device, dtype)
            adv = torch.where(m, a.unsqueeze(-1).expand_as(train) if a.dim() == 1 else a, zero)
        params = ISParams(cap, low, high, seq_low, seq_high, prob_low, prob_high)
        return fn(log_ratio, m, params, ISInputs(train, gen, adv))


def importance_from_config(loss, train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor,
                           advantages: torch.Tensor | None = None) -> ISWeights:
    """compute_importance with every parameter read from a run config's `loss` section (a LossSpec:
    importance_sampling, is_cap, is_low, is_high, is_seq_low, is_seq_high, is_prob_low, is_prob_high), so
    that a caller passes the section, not each knob. Shapes as compute_importance."""
    return compute_importance(train_logprobs, gen_logprobs, mask, loss.importance_sampling, loss.is_cap,
                              loss.is_low, loss.is_high, seq_low=loss.is_seq_low, seq_high=loss.is_seq_high,
                              prob_low=loss.is_prob_low, prob_high=loss.is_prob_high, advantages=advantages)


def importance_weights(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor,
                       variant: str, cap: float = 2.0, low: float = 0.5, high: float = 5.0,
                       **kwargs) -> torch.Tensor:
    """Float[B, T] detached IS weights of `variant` (a name in IS_VARIANTS), 0 off-mask; kwargs: the
    keyword-only parameters of compute_importance (seq_low, seq_high, prob_low, prob_high, advantages)."""
    return compute_importance(train_logprobs, gen_logprobs, mask, variant, cap, low, high, **kwargs).weights


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
                                  high: float = 5.0, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """(weights Float[B, T], importance_stats): what a training step needs in one call (kwargs as
    importance_weights)."""
    isw = compute_importance(train_logprobs, gen_logprobs, mask, variant, cap, low, high, **kwargs)
    return isw.weights, importance_stats(isw)
