"""Next-token sampling for the generation engine: temperature, top-k, top-p, greedy, and the
log-probability of the token that was picked.

Shapes: B rows, V vocabulary entries. All math is FP32 (logits are upcast first, as vLLM's sampler does).

Reported log-prob (a choice, documented in GenerationOutput): `log_softmax(logits / T)[token]` in FP32,
taken *after temperature and before top-k/top-p filtering*. That is the quantity the training engine can
recompute from a full-sequence forward (it knows T, not the filtered support), so the mismatch metric
measures kernel numerics and not the filter. vLLM's `logprobs_mode="processed_logprobs"` reports the
log-prob after every processor, top-k/top-p included (renormalised over the kept tokens); the two agree
exactly when top-k/top-p are off (the study's rollouts: top_p=1, top_k=0). Greedy decoding reports the
log-prob under T=1.

Sampling draws with the exponential race (`argmax p_i / E_i`, E_i ~ Exp(1)), which picks token i with
probability p_i exactly and costs one vectorised draw per row: vLLM's FlashInfer-free sampling path does
the same. Draws come from the engine's own `torch.Generator`, so a seed fixes the stream.
"""
from __future__ import annotations

import torch

from fp8rl_core.engines.base import SamplingParams


def validate_sampling(sampling: SamplingParams) -> None:
    """Raise ValueError naming the field when a SamplingParams value is out of range."""
    if sampling.max_new_tokens < 1:
        raise ValueError(f"sampling.max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    if not sampling.greedy and not sampling.temperature > 0:
        raise ValueError(f"sampling.temperature must be > 0 (use greedy=True for argmax), "
                         f"got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise ValueError(f"sampling.top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        raise ValueError(f"sampling.top_k must be >= 0 (0: off), got {sampling.top_k}")


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Float32[B, V] tempered logits -> the same with tokens outside the top-k / top-p set at -inf.

    top-k keeps the k largest logits (ties at the k-th value are kept too); top-p keeps the smallest
    prefix of the descending-sorted distribution whose mass reaches top_p (the top token always stays).
    Both apply to the tempered distribution, top-k first (HF and vLLM order).
    """
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly better tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Float32 logits / T (FP32 first, as vLLM's sampler; no division at T = 1): what log-probs are taken of."""
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def sample_next(logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    logits: [B, V] (any float dtype; upcast to FP32 here)
    returns (tokens Long[B], logprobs Float32[B]) with logprobs = log_softmax(logits / T)[token],
    T = 1 when greedy.
    """
    if sampling.greedy:
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logits = tempered(logits, sampling.temperature)
    logp = torch.log_softmax(logits, dim=-1)
    filtered = filter_top_k_top_p(logits, sampling.top_k, sampling.top_p)
    probs = torch.softmax(filtered, dim=-1) if filtered is not logits else logp.exp()
    # clamp: an Exp(1) draw of exactly 0 would turn a filtered 0-probability token into 0/0 = NaN
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(torch.float32).tiny)
    tokens = (probs / race).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
