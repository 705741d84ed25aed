"""make_task: the run config's task section -> a task object."""
from __future__ import annotations

import json

import pytest

from fp8rl_core.config import TaskSpec, run_config_from_dict
from fp8rl_core.config.schema import ConfigError
from fp8rl_core.tasks import ArithmeticTask, JsonlTask, make_task


def test_default_spec_is_the_arithmetic_task():
    task = make_task(TaskSpec())
    assert isinstance(task, ArithmeticTask)
    spec = TaskSpec()
    assert (task.digits, task.min_digits, task.operators) == (spec.digits, spec.min_digits, tuple(spec.operators))
    assert len(task.val_examples) == spec.val_size and task.warmstart_digits == spec.digits


def test_spec_fields_reach_the_task():
    cfg = run_config_from_dict({"task": {"digits": 2, "operators": ["*"], "val_size": 16, "data_seed": 5,
                                         "warmstart_digits": 1, "warmstart_full_fraction": 0.25}})
    task = make_task(cfg.task)
    assert task.operators == ("*",) and task.data_seed == 5 and len(task.val_examples) == 16
    assert (task.warmstart_digits, task.warmstart_full_fraction) == (1, 0.25)
    assert task.val_examples == ArithmeticTask(digits=2, operators=("*",), val_size=16, data_seed=5).val_examples


def test_warmstart_knobs_are_validated_by_the_config():
    with pytest.raises(ConfigError, match="task.warmstart_digits"):
        run_config_from_dict({"task": {"digits": 2, "warmstart_digits": 3}})
    with pytest.raises(ConfigError, match="task.warmstart_full_fraction"):
        run_config_from_dict({"task": {"warmstart_full_fraction": -0.1}})


def test_jsonl_spec(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(10)))
    task = make_task(TaskSpec(name="jsonl", train_path=str(path), val_size=3))
    assert isinstance(task, JsonlTask) and task.answer_type == "string" and len(task.val_examples) == 2


def test_unknown_task_lists_the_supported_ones():
    spec = TaskSpec()
    spec.name = "chess"  # bypasses the config's own Literal check
    with pytest.raises(ValueError, match="unknown task 'chess'; valid: arithmetic, jsonl, reasoning_gym"):
        make_task(spec)
