"""Tasks: prompts with reference answers, a fixed held-out set, and an exact-match reward.

`make_task(spec)` builds the task a run config names (`task.name`): `arithmetic` (the default,
synthetic), `jsonl` (the user's data) or `reasoning_gym` (its procedural datasets and scorers; an
optional extra).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fp8rl_core.tasks.arithmetic import ArithmeticTask
from fp8rl_core.tasks.base import Example, Task, as_random, exact_match
from fp8rl_core.tasks.jsonl import JsonlTask, TaskDataError
from fp8rl_core.tasks.reasoning_gym import ReasoningGymTask

__all__ = ["ArithmeticTask", "Example", "JsonlTask", "ReasoningGymTask", "Task", "TaskDataError", "TASKS", "as_random",
           "exact_match", "make_task"]


def _arithmetic(spec: Any) -> Task:
    return ArithmeticTask(digits=spec.digits, min_digits=spec.min_digits, operators=tuple(spec.operators),
                          val_size=spec.val_size, data_seed=spec.data_seed,
                          warmstart_digits=spec.warmstart_digits,
                          warmstart_full_fraction=spec.warmstart_full_fraction,
                          warmstart_label_noise=spec.warmstart_label_noise, scratchpad=spec.scratchpad)


def _jsonl(spec: Any) -> Task:
    if not spec.train_path:
        raise ValueError("task.train_path: required when task.name is jsonl")
    return JsonlTask(spec.train_path, val_path=spec.val_path, answer_type=spec.answer_type,
                     val_size=spec.val_size, data_seed=spec.data_seed)


def _reasoning_gym(spec: Any) -> Task:
    return ReasoningGymTask(spec.dataset, spec.options, val_size=spec.val_size, train_size=spec.train_size,
                            data_seed=spec.data_seed, instruction=spec.instruction, extract=spec.extract)


TASKS: dict[str, Callable[[Any], Task]] = {"arithmetic": _arithmetic, "jsonl": _jsonl,
                                           "reasoning_gym": _reasoning_gym}


def make_task(spec: Any) -> Task:
    """The task of a `fp8rl_core.config.TaskSpec`; an unknown name lists the supported ones."""
    if spec.name not in TASKS:
        raise ValueError(f"task.name: unknown task {spec.name!r}; valid: {', '.join(TASKS)}")
    return TASKS[spec.name](spec)
