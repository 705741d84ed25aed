"""Validation accuracy: greedy decoding of the fixed held-out set by the generation engine.

Greedy (argmax) rather than sampled, so that the number moves with the policy and not with sampling
noise; it runs on the generation engine, i.e. with the recipe's FP8 or BF16 kernels, as a deployed
model would answer.
"""
from __future__ import annotations

from typing import Any

from fp8rl_core.engines.base import GenerationEngine, SamplingParams


def validation_accuracy(gen: GenerationEngine, tokenizer: Any, task: Any, max_new_tokens: int,
                        batch_size: int = 256) -> float:
    """Fraction of `task.val_examples` whose greedy completion earns reward 1."""
    examples = task.val_examples
    correct = 0.0
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        out = gen.generate([tokenizer.encode(ex.prompt) for ex in chunk], greedy)
        lengths = out.response_mask.sum(dim=1).tolist()
        for i, ex in enumerate(chunk):
            correct += task.reward(ex, tokenizer.decode(out.response_ids[i, :lengths[i]].tolist()))
    return correct / max(len(examples), 1)
