"""The two engine interfaces. A backend is one file implementing one of these, not a fork of the loop.

Shapes: B sequences; R response tokens; T = prompt + response tokens of a training batch.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    greedy: bool = False  # argmax decoding (validation); logprobs are then those of the T=1 distribution
    seed: int | None = None  # seeds the engine's sampling generator for this call; None: continue its stream


@dataclass
class GenerationOutput:
    """What a generation engine returns for B prompts.

    response_ids:  Long[B, R]  sampled tokens, right-padded with pad_token_id
    response_mask: Bool[B, R]  True for tokens up to and including the first EOS
    logprobs:      Float32[B, R] log-prob of each sampled token under the sampling distribution
                   (logits / temperature, before top-k/top-p filtering, as vLLM reports processed
                   logprobs); 0 where response_mask is False
    finished:      Bool[B]     the sequence ended with EOS (else it hit max_new_tokens)
    """

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor


class GenerationEngine(Protocol):
    generator: torch.Generator  # the sampling stream; checkpointed so that a resumed run samples the same

    def refit(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Load trainer weights (HF state_dict names); FP8 recipes quantize linears [128,128] here, once."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample continuations of token-id prompts (any lengths) with a KV cache."""


def awake(engine: Any) -> contextlib.AbstractContextManager:
    """Hold a generation engine awake over several generate calls (its `awake()`; the vLLM engine would
    otherwise sleep after each one, fp8rl_core/engines/vllm_gen.py); nothing for an engine without sleep."""
    hold = getattr(engine, "awake", None)
    return hold() if hold is not None else contextlib.nullcontext(engine)


def sleep(engine: Any, level: int) -> None:
    """Release a generation engine's GPU memory: level 2 when its next use is a refit, 1 when the same
    weights serve again (vllm_gen.py); nothing for an engine without sleep."""
    release = getattr(engine, "sleep", None)
    if release is not None:
        release(level=level)


@dataclass
class TrainBatch:
    """A training batch of prompt+response sequences, right-padded.

    input_ids:      Long[B, T]
    attention_mask: Bool[B, T]   True on real (prompt or response) tokens
    response_mask:  Bool[B, T]   True on response tokens that count (up to and including EOS)
    advantages:     Float32[B, T] per-token advantage (the sequence's advantage broadcast)
    gen_logprobs:   Float32[B, T] generation engine's log-probs of input_ids[:, t]; 0 off-mask
    old_logprobs:   Float32[B, T] training engine's log-probs before the update (ratio denominator)
    is_weights:     Float32[B, T] importance-sampling weights (detached; 1 when IS is off)
    ref_logprobs:   Float32[B, T] reference policy log-probs for the KL term, or None
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    gen_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> TrainBatch:
        """The sub-batch of the given row indices (for optimizer micro-steps)."""
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return TrainBatch(*(pick(getattr(self, f)) for f in self.__dataclass_fields__))


class TrainingEngine(Protocol):
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Float32[B, T]: log p(input_ids[:, t] | input_ids[:, :t]) / temperature-scaled, no grad;
        0 where response_mask is False (position 0 is never a response token)."""

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step of the GRPO loss on `batch`; returns metrics (loss, grad_norm, ...)."""

    def weights(self) -> dict[str, torch.Tensor]:
        """Current weights, HF state_dict names, for refitting the generation engine."""

    def state_dict(self) -> dict:
        """Everything needed to resume bit-exactly: model, optimizer (and its step)."""

    def load_state_dict(self, state: dict) -> None: ...
