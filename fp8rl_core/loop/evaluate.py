"""Validation accuracy on the fixed held-out set, measured on the generation engine.

Two numbers, both on the recipe's own generation kernels (FP8 or BF16), as a deployed model answers:
- `val_accuracy`: pass@1 at the rollout temperature, i.e. mean reward of `val_samples` sampled
  answers per held-out prompt — what NeMo RL reports as validation accuracy, and what RL optimizes;
- `val_accuracy_greedy`: argmax decoding, one answer per prompt.
Validation draws from a fixed seed and restores the engine's sampling stream afterwards, so it neither
perturbs training nor adds sampling noise between validation points.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from fp8rl_core.engines.base import GenerationEngine, SamplingParams
from fp8rl_core.tracking import M_VAL_ACC

VAL_SEED = 20_240_917


def _mean_reward(gen: GenerationEngine, tokenizer: Any, task: Any, examples: list, sampling: SamplingParams,
                 batch_size: int) -> float:
    total = 0.0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        out = gen.generate([tokenizer.encode(ex.prompt) for ex in chunk], sampling)
        lengths = out.response_mask.sum(dim=1).tolist()
        for i, ex in enumerate(chunk):
            total += task.reward(ex, tokenizer.decode(out.response_ids[i, :lengths[i]].tolist()))
        sampling = replace(sampling, seed=None)  # seed once per validation, then continue the stream
    return total / max(len(examples), 1)


def greedy_accuracy(gen: GenerationEngine, tokenizer: Any, task: Any, examples: list, max_new_tokens: int,
                    batch_size: int = 512) -> float:
    """Mean exact-match reward of argmax decoding on `examples` (no sampling stream is used)."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    return _mean_reward(gen, tokenizer, task, examples, greedy, batch_size)


def validation_metrics(gen: GenerationEngine, tokenizer: Any, task: Any, sampling: SamplingParams,
                       samples: int, batch_size: int = 512, greedy: bool = True) -> dict[str, float]:
    """{'val_accuracy': sampled pass@1 over `samples` draws per prompt, 'val_accuracy_greedy': ...}.
    greedy=False: val_accuracy alone (no greedy pass unless samples is 0, when it is val_accuracy)."""
    saved = gen.generator.get_state()
    try:
        out = {}
        if greedy or samples == 0:
            out["val_accuracy_greedy"] = greedy_accuracy(gen, tokenizer, task, task.val_examples,
                                                         sampling.max_new_tokens, batch_size)
        repeated = [ex for ex in task.val_examples for _ in range(samples)]
        out[M_VAL_ACC] = (_mean_reward(gen, tokenizer, task, repeated, replace(sampling, seed=VAL_SEED),
                                            batch_size) if samples > 0 else out["val_accuracy_greedy"])
        return out if greedy else {M_VAL_ACC: out[M_VAL_ACC]}
    finally:
        gen.generator.set_state(saved)
