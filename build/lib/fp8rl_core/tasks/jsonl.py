"""A task from the user's JSONL: one `{"prompt": ..., "answer": ...}` object per line.

Answers are checked as numbers (`numeric`: "3.0" == "3" == "3e0", compared exactly as decimals) or as
strings (`string`: exact after stripping); `auto` picks numeric when every answer is a number. Without a
`val_path`, a deterministic split (seeded by `data_seed`) holds out min(val_size, 20% of the rows).
Training rows whose prompt is also a validation prompt are dropped, so validation stays held out.
"""
from __future__ import annotations

import json
import random
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Literal

from fp8rl_core.tasks.base import Example, Rng, Task, as_random, exact_match

AnswerType = Literal["auto", "numeric", "string"]
# Plain decimal literals only: Python's float() would also take "nan", "inf" and "1_000".
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


class TaskDataError(ValueError):
    """A bad line in a task data file; the message names file:line."""


def parse_number(text: str) -> Decimal | None:
    """The number `text` spells (after stripping), or None if it is not a plain decimal literal."""
    s = text.strip()
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def read_jsonl(path: str | Path) -> list[Example]:
    """Examples of a JSONL file; blank lines are skipped; a bad line raises TaskDataError(file:line)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"task data file not found: {path}")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                out.append(_parse_line(line, f"{path}:{lineno}"))
    if not out:
        raise TaskDataError(f"{path}: no examples (expected one JSON object per line)")
    return out


def _parse_line(line: str, where: str) -> Example:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise TaskDataError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict) or "prompt" not in row or "answer" not in row:
        raise TaskDataError(f'{where}: expected an object with "prompt" and "answer", got {line.strip()[:80]}')
    prompt, answer = row["prompt"], row["answer"]
    if not isinstance(prompt, str) or not prompt:
        raise TaskDataError(f'{where}: "prompt" must be a non-empty string, got {prompt!r}')
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise TaskDataError(f'{where}: "answer" must be a string or a number, got {answer!r}')
    answer = str(answer).strip()
    if not answer:
        raise TaskDataError(f'{where}: "answer" is empty')
    return Example(prompt, answer)


class JsonlTask(Task):
    name = "jsonl"

    def __init__(self, train_path: str | Path, val_path: str | Path | None = None,
                 answer_type: AnswerType = "auto", val_size: int = 128, data_seed: int = 1234):
        if answer_type not in ("auto", "numeric", "string"):
            raise ValueError(f"task.answer_type: {answer_type!r} is not allowed; valid: auto, numeric, string")
        if val_size < 1:
            raise ValueError(f"task.val_size: must be >= 1, got {val_size}")
        rows = read_jsonl(train_path)
        if val_path is not None:
            val = read_jsonl(val_path)[:val_size]
        else:
            if len(rows) < 2:
                raise TaskDataError(f"{train_path}: need at least 2 examples to hold some out (or a val_path)")
            order = list(range(len(rows)))
            random.Random(data_seed).shuffle(order)
            n_val = min(val_size, max(1, len(rows) // 5))
            val = [rows[i] for i in sorted(order[:n_val])]
        held_out = {e.prompt for e in val}
        self.train_examples = [e for e in rows if e.prompt not in held_out]
        if not self.train_examples:
            raise TaskDataError(f"{train_path}: every training prompt is also a validation prompt")
        self.val_examples = val
        self.answer_type = self._resolve(answer_type, train_path)

    def _resolve(self, answer_type: AnswerType, train_path: str | Path) -> Literal["numeric", "string"]:
        examples = self.train_examples + self.val_examples
        all_numeric = all(parse_number(e.answer) is not None for e in examples)
        if answer_type == "auto":
            return "numeric" if all_numeric else "string"
        if answer_type == "numeric" and not all_numeric:
            bad = next(e for e in examples if parse_number(e.answer) is None)
            raise TaskDataError(f"{train_path}: answer_type is numeric but answer {bad.answer!r} "
                                f"(prompt {bad.prompt!r}) is not a number")
        return answer_type

    def alphabet(self) -> str:
        rows = self.train_examples + self.val_examples
        return "".join(sorted({c for e in rows for c in e.prompt + e.answer}))

    def sample_train(self, rng: Rng, n: int) -> list[Example]:
        """n training rows drawn uniformly with replacement."""
        return as_random(rng).choices(self.train_examples, k=n)

    def reward(self, example: Example, completion: str) -> float:
        if self.answer_type == "string":
            return exact_match(example.answer, completion)
        got = parse_number(completion)
        return 1.0 if got is not None and got == parse_number(example.answer) else 0.0
