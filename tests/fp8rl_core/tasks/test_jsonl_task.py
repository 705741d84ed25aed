"""The JSONL task: numeric/string answer checking, file:line errors, held-out splits."""
from __future__ import annotations

import json
import random

import pytest

from fp8rl_core.tasks import Example, JsonlTask, TaskDataError


def write(path, rows, raw_lines=()):
    lines = [json.dumps(r) for r in rows] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def numeric_rows(n):
    return [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(n)]


def test_numeric_answers_compare_as_numbers(tmp_path):
    task = JsonlTask(write(tmp_path / "t.jsonl", numeric_rows(20)))
    assert task.answer_type == "numeric"
    ex = Example("p", "3")
    for good in ("3", " 3 ", "3.0", "+3", "3e0", "0.3e1", "3."):
        assert task.reward(ex, good) == 1.0, good
    for bad in ("4", "3.01", "three", "", "3 apples", "nan", "inf", "1_0"):
        assert task.reward(ex, bad) == 0.0, bad
    assert task.reward(Example("p", "-0.5"), "-.5") == 1.0
    assert task.reward(Example("p", "0.1"), "0.10000000000000001") == 0.0  # exact decimals, no float fuzz


def test_string_answers_and_auto_detection(tmp_path):
    rows = numeric_rows(10) + [{"prompt": "capital of France?", "answer": "Paris"}]
    task = JsonlTask(write(tmp_path / "t.jsonl", rows))
    assert task.answer_type == "string"
    ex = Example("capital of France?", "Paris")
    assert task.reward(ex, " Paris\n") == 1.0 and task.reward(ex, "paris") == 0.0
    assert task.reward(Example("p", "3"), "3.0") == 0.0  # strings: exact
    forced = JsonlTask(tmp_path / "t.jsonl", answer_type="string")
    assert forced.answer_type == "string"
    with pytest.raises(TaskDataError, match=r"answer_type is numeric but answer 'Paris'"):
        JsonlTask(tmp_path / "t.jsonl", answer_type="numeric")
    with pytest.raises(ValueError, match="valid: auto, numeric, string"):
        JsonlTask(tmp_path / "t.jsonl", answer_type="float")


def test_json_number_answers(tmp_path):
    rows = [{"prompt": "a", "answer": 3}, {"prompt": "b", "answer": 2.5}, {"prompt": "c", "answer": "7"}]
    task = JsonlTask(write(tmp_path / "t.jsonl", rows), val_path=write(tmp_path / "v.jsonl", rows[:1]))
    assert [e.answer for e in task.train_examples] == ["2.5", "7"]
    assert task.val_examples == [Example("a", "3")]


@pytest.mark.parametrize("line,match", [
    ("{not json", "not valid JSON"),
    ('{"prompt": "x"}', 'expected an object with "prompt" and "answer"'),
    ('["x", "1"]', 'expected an object'),
    ('{"prompt": 5, "answer": "1"}', '"prompt" must be a non-empty string'),
    ('{"prompt": "x", "answer": true}', '"answer" must be a string or a number'),
    ('{"prompt": "x", "answer": " "}', '"answer" is empty'),
])
def test_bad_lines_name_file_and_line(tmp_path, line, match):
    # line 1 ok, line 2 blank (skipped but counted), line 3 bad
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n\n" + line + "\n")
    with pytest.raises(TaskDataError, match=f"{path}:3: {match}"):
        JsonlTask(path)


def test_empty_and_missing_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TaskDataError, match="no examples"):
        JsonlTask(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        JsonlTask(tmp_path / "nowhere.jsonl")
    with pytest.raises(TaskDataError, match="at least 2 examples"):
        JsonlTask(write(tmp_path / "one.jsonl", numeric_rows(1)))


def test_held_out_split_is_deterministic_and_disjoint(tmp_path):
    path = write(tmp_path / "t.jsonl", numeric_rows(50))
    a, b = JsonlTask(path, val_size=128, data_seed=1), JsonlTask(path, val_size=128, data_seed=1)
    assert a.val_examples == b.val_examples and len(a.val_examples) == 10  # capped at 20% of 50 rows
    assert len(JsonlTask(path, val_size=4).val_examples) == 4
    assert JsonlTask(path, data_seed=2).val_examples != a.val_examples
    val = {e.prompt for e in a.val_examples}
    assert not val & {e.prompt for e in a.train_examples}
    assert len(a.train_examples) == 40
    drawn = a.sample_train(random.Random(0), 500)
    assert drawn == a.sample_train(random.Random(0), 500)
    assert not val & {e.prompt for e in drawn} and len({e.prompt for e in drawn}) == 40


def test_val_file_caps_and_removes_overlap(tmp_path):
    rows = numeric_rows(30)
    train = write(tmp_path / "train.jsonl", rows)
    val = write(tmp_path / "val.jsonl", rows[:5] + [{"prompt": "new", "answer": "1"}])
    task = JsonlTask(train, val_path=val, val_size=100)
    assert len(task.val_examples) == 6
    assert len(task.train_examples) == 25  # the 5 prompts also in val are dropped from training
    assert len(JsonlTask(train, val_path=val, val_size=2).val_examples) == 2
    with pytest.raises(TaskDataError, match="every training prompt is also a validation prompt"):
        JsonlTask(write(tmp_path / "small.jsonl", rows[:3]), val_path=val)


def test_alphabet_covers_all_rows(tmp_path):
    rows = [{"prompt": "Is 7 > 3?", "answer": "yes"}, {"prompt": "Is 2 > 9?", "answer": "no"}] * 3
    task = JsonlTask(write(tmp_path / "t.jsonl", rows))
    assert task.alphabet() == "".join(sorted(set("Is 7 > 3?yesIs 2 > 9?no")))
