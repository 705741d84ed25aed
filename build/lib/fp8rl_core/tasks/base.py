"""What a task is to the RL core: prompts with reference answers, a held-out set, and a reward.

A task owns its data, fixed by its own data seed (the same in every sweep cell); the run's RNG only
decides which training examples a step sees, so `sample_train(rng, n)` is deterministic given the RNG
state (what a resumed run restores).
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

Rng = random.Random | torch.Generator | int


@dataclass(frozen=True)
class Example:
    prompt: str  # what the policy is conditioned on, e.g. "123+45="
    answer: str  # the reference completion, e.g. "168" (no EOS: the tokenizer's EOS ends it)


def as_random(rng: Rng) -> random.Random:
    """A `random.Random` driven by `rng`: itself, a new one seeded by an int, or one seeded by a draw
    from a torch.Generator (which advances that generator, so successive calls differ)."""
    if isinstance(rng, random.Random):
        return rng
    if isinstance(rng, torch.Generator):
        return random.Random(int(torch.randint(0, 2**62, (1,), generator=rng)))
    if isinstance(rng, int) and not isinstance(rng, bool):
        return random.Random(rng)
    raise TypeError(f"rng must be random.Random, torch.Generator or int, got {type(rng).__name__}")


def exact_match(answer: str, completion: str) -> float:
    """1.0 when the completion equals the answer after stripping surrounding whitespace, else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


class Task(ABC):
    """A task: fixed `val_examples` (disjoint from training prompts), training sampling, reward."""

    name: str = "task"
    val_examples: list[Example]

    @abstractmethod
    def sample_train(self, rng: Rng, n: int) -> list[Example]:
        """n training examples (never a validation prompt), drawn with `rng`."""

    def warmstart_sample(self, rng: Rng, n: int) -> list[Example]:
        """n examples for the supervised warm start; the RL distribution unless a task makes it easier."""
        return self.sample_train(rng, n)

    def reward(self, example: Example, completion: str) -> float:
        """Reward of a decoded completion (EOS and what follows already cut): exact match, 1.0 / 0.0."""
        return exact_match(example.answer, completion)

    def sft_text(self, example: Example) -> tuple[str, str]:
        """(prompt, target) for the warm start; the loss covers the target and then EOS."""
        return example.prompt, example.answer

    def alphabet(self) -> str:
        """Every character a prompt or answer can contain (sorted), e.g. to build a character tokenizer."""
        return "".join(sorted({c for e in self.val_examples for c in e.prompt + e.answer}))

    def accuracy(self, examples: list[Example], completions: list[str]) -> float:
        """Mean reward of completions[i] for examples[i] (validation accuracy with a 0/1 reward)."""
        if len(examples) != len(completions) or not examples:
            raise ValueError(f"need as many completions ({len(completions)}) as examples ({len(examples)}), "
                             "and at least one")
        return sum(self.reward(e, c) for e, c in zip(examples, completions)) / len(examples)
