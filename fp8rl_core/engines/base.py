"""The two engine interfaces. A backend is one file implementing one of these, not a fork of the loop.

Shapes: B sequences; R response tokens; T = prompt + response tokens of a training batch.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from fp8rl_core.engines.kv_quant import KVScales
from fp8rl_core.model.config import ModelConfig


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
    """What the loop calls on a generation engine (native_gen.py, vllm_gen.py, bf16_eval.py). An engine without
    a sleep mode keeps its weights: `sleep` and `awake` do nothing there, `start` nothing either."""

    generator: torch.Generator  # the sampling stream; checkpointed so that a resumed run samples the same
    config: ModelConfig  # the architecture it runs (saved with a rollout for `explain`)

    def start(self, model_dir: str | Path) -> None:
        """Start on the HF checkpoint folder `model_dir` before any refit (vLLM: its server and sleep mode)."""

    def refit(self, weights: Mapping[str, torch.Tensor], *, step: int | None = None,
              kv_scales: KVScales | None = None) -> None:
        """Load trainer weights (HF state_dict names); FP8 recipes quantize linears [128,128] here, once.
        step, kv_scales: an E4M3 KV cache's (fp8.kv_cache e4m3) weights step and per-layer scales
        (engines/kv_quant.py); an engine without that cache refuses kv_scales."""

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        """Sample continuations of token-id prompts (any lengths) with a KV cache."""

    def score(self, prompts: list[list[int]], output: GenerationOutput, temperature: float) -> torch.Tensor:
        """Float32[B, R]: the log-probs of `output`'s tokens replaying generate's own computation
        (engines.kernels: matched; 0 off output.response_mask). An engine that cannot replay raises."""

    def sleep(self, level: int = 2) -> None:
        """Release GPU memory: level 2 when the next use is a refit, 1 when the same weights serve again."""

    def awake(self) -> contextlib.AbstractContextManager:
        """Hold the engine awake over several generate calls (vLLM would sleep after each one)."""

    def tags(self) -> dict[str, str]:
        """What runs the engine (version, device, FP8 kernels), as MLflow tags; {} when nothing to say."""

    def kv_scales_in_use(self) -> tuple[float, float] | None:
        """(step, checksum) of the E4M3 KV scales the last generate call used; None without that cache."""

    def held_kv_scales(self) -> KVScales | None:
        """The per-layer KV scales held for the current weights (a checkpoint keeps them); None if none."""


def awake(engine: GenerationEngine) -> contextlib.AbstractContextManager:
    """Hold a generation engine awake over several generate calls (GenerationEngine.awake)."""
    return engine.awake()


def sleep(engine: GenerationEngine, level: int) -> None:
    """Release a generation engine's GPU memory (GenerationEngine.sleep; vllm_gen.py)."""
    engine.sleep(level=level)


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


@dataclass(frozen=True)
class TrainResult:
    """What TrainingEngine.train_step returns.

    metrics:      loss, grad_norm, lr, ... (names per the MLflow contract, docs/design.md)
    old_logprobs: Float32[B, T] the old log-probs the step used, 0 off response_mask (the training forward's
                  own, detached, when the batch came without them); None where the engine does not report
                  them (TrainingEngine.reports_old_logprobs False)
    is_weights:   Float32[B, T] the IS weights the step used, or None (as old_logprobs)
    """

    metrics: dict[str, float]
    old_logprobs: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None


Importance = Callable[[TrainBatch], torch.Tensor]  # sub-batch with old_logprobs -> IS weights Float32[b, T]


class LogprobEngine(Protocol):
    """Scores batches only: the frozen reference policy of the KL term (native_train.ReferencePolicy)."""

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Float32[B, T]: log p(input_ids[:, t] | input_ids[:, :t]) / temperature-scaled, no grad;
        0 where response_mask is False (position 0 is never a response token)."""


class TrainingEngine(LogprobEngine, Protocol):
    # True: train_step(batch without old_logprobs, importance=...) scores the batch in its own forward and
    # returns the old log-probs and IS weights it used (TrainResult), which saves the separate scoring pass
    reports_old_logprobs: bool

    def train_step(self, batch: TrainBatch, importance: Importance | None = None,
                   step_mismatch: float | None = None) -> TrainResult:
        """One optimizer step of the GRPO loss on `batch`: its metrics (loss, grad_norm, ...) and, where
        reports_old_logprobs, the old log-probs / IS weights it used. importance: IS weights of a sub-batch
        from its old log-probs (when the batch has none); step_mismatch: the rollout step's mismatch for
        the mismatch guard (engines/guard.py), None: the guard measures this batch."""

    def weights(self) -> Mapping[str, torch.Tensor]:
        """Current weights, HF state_dict names, for refitting the generation engine."""

    def state_dict(self) -> dict:
        """Everything needed to resume bit-exactly: model, optimizer (and its step)."""

    def load_state_dict(self, state: dict) -> None: ...
