"""The arithmetic task: answers checked by re-parsing each prompt, held-out prompts never trained on."""
from __future__ import annotations

import random
import re

import pytest
import torch

from fp8rl_core.model.tokenizer import CHARS
from fp8rl_core.tasks import ArithmeticTask, Example

PROMPT = re.compile(r"(0|[1-9]\d*)([+*-])(0|[1-9]\d*)=")


def solve(prompt: str) -> tuple[int, str, int, str]:
    """(a, op, b, answer) from the prompt text, independently of the task's generator."""
    m = PROMPT.fullmatch(prompt)
    assert m, f"bad prompt format {prompt!r}"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return a, op, b, str(value)


def test_validation_set_is_fixed_distinct_and_correct():
    task = ArithmeticTask(digits=3, operators=("+", "-"), val_size=128, data_seed=7)
    assert len(task.val_examples) == 128
    assert len({e.prompt for e in task.val_examples}) == 128
    for e in task.val_examples:
        a, op, b, answer = solve(e.prompt)
        assert e.answer == answer and op in "+-" and a < 1000 and b < 1000
    assert ArithmeticTask(digits=3, val_size=128, data_seed=7).val_examples == task.val_examples
    assert ArithmeticTask(digits=3, val_size=128, data_seed=8).val_examples != task.val_examples
    assert any(e.answer.startswith("-") for e in task.val_examples)  # negative results occur


def test_training_never_sees_validation_prompts_and_covers_the_rest():
    # a tiny space (10 x 10 sums) so that collisions with held-out prompts are certain
    task = ArithmeticTask(digits=1, operators=("+",), val_size=25, data_seed=3)
    val = {e.prompt for e in task.val_examples}
    seen = {e.prompt for e in task.sample_train(random.Random(0), 3000)}
    seen |= {e.prompt for e in task.warmstart_sample(random.Random(1), 3000)}
    assert not seen & val
    assert len(seen) == 100 - 25  # every other prompt is reachable


def test_operand_digits_and_answer_lengths():
    task = ArithmeticTask(digits=3, min_digits=2, operators=("+", "-", "*"), val_size=16)
    exs = task.sample_train(random.Random(0), 2000)
    ops = set()
    for e in exs:
        a, op, b, answer = solve(e.prompt)
        ops.add(op)
        assert 10 <= a <= 999 and 10 <= b <= 999 and e.answer == answer
        assert len(e.answer) <= 6 and set(e.prompt + e.answer) <= set(CHARS)
    assert ops == {"+", "-", "*"}
    # digit counts are uniform over [min_digits, digits]: about half 2-digit, half 3-digit operands
    two = sum(solve(e.prompt)[0] < 100 for e in exs) / len(exs)
    assert 0.45 < two < 0.55


def test_sampling_is_deterministic_for_each_rng_kind():
    task = ArithmeticTask()
    assert task.sample_train(random.Random(5), 20) == task.sample_train(random.Random(5), 20)
    assert task.sample_train(11, 20) == task.sample_train(11, 20)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert task.sample_train(g1, 20) == task.sample_train(g2, 20)
    assert task.sample_train(g1, 20) != task.sample_train(torch.Generator().manual_seed(3), 20)  # g1 advanced
    rnd = random.Random(9)
    first = task.sample_train(rnd, 10)
    assert task.sample_train(rnd, 10) != first  # a random.Random is advanced, not reseeded
    with pytest.raises(TypeError, match="rng must be"):
        task.sample_train("seed", 1)


def test_warm_start_distribution_knobs():
    task = ArithmeticTask(digits=3, warmstart_digits=1, warmstart_full_fraction=0.0, val_size=32)
    for e in task.warmstart_sample(random.Random(0), 500):
        a, _, b, _ = solve(e.prompt)
        assert a < 10 and b < 10
    mixed = ArithmeticTask(digits=3, warmstart_digits=1, warmstart_full_fraction=0.5, val_size=32)
    long_ops = sum(max(solve(e.prompt)[0], solve(e.prompt)[2]) >= 10
                   for e in mixed.warmstart_sample(random.Random(0), 4000)) / 4000
    # half the examples come from the full distribution, where P(an operand has >= 2 digits) = 1 - 1/9
    assert long_ops == pytest.approx(0.5 * (1 - 1 / 9), abs=0.03)
    same = ArithmeticTask(digits=2, val_size=32)  # default: the warm start sees the RL distribution
    assert same.warmstart_sample(random.Random(4), 50) == same.sample_train(random.Random(4), 50)


def test_reward_sft_and_accuracy():
    task = ArithmeticTask(val_size=8)
    ex = Example("123+45=", "168")
    assert task.reward(ex, "168") == 1.0 and task.reward(ex, " 168 ") == 1.0
    assert task.reward(ex, "0168") == 0.0 and task.reward(ex, "16") == 0.0 and task.reward(ex, "") == 0.0
    assert task.reward(Example("7-12=", "-5"), "-5") == 1.0
    assert task.sft_text(ex) == ("123+45=", "168")
    assert task.accuracy([ex, ex], ["168", "x"]) == 0.5
    with pytest.raises(ValueError, match="as many completions"):
        task.accuracy([ex], [])


@pytest.mark.parametrize("kwargs,match", [
    ({"digits": 10}, "1 <= min_digits <= digits <= 9"),
    ({"min_digits": 3, "digits": 2}, "min_digits <= digits"),
    ({"operators": ("/",)}, r"\['/'\] not allowed; valid: \+, -, \*"),
    ({"operators": ()}, "empty"),
    ({"digits": 1, "operators": ("+",), "val_size": 26}, "need 1 <= val_size <= 25"),
    ({"warmstart_digits": 4}, "warmstart_digits"),
    ({"warmstart_full_fraction": 1.5}, "warmstart_full_fraction"),
])
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArithmeticTask(**kwargs)


def test_alphabet_is_what_prompts_and_answers_use():
    task = ArithmeticTask(operators=("+", "*"), val_size=32)
    used = {c for e in task.sample_train(random.Random(0), 500) + task.val_examples for c in e.prompt + e.answer}
    assert used == set(task.alphabet()) and "-" not in used
    assert set(ArithmeticTask(operators=("-",), val_size=32).alphabet()) == set("0123456789-=")


def test_warmstart_label_noise_corrupts_exactly_one_digit():
    import random

    from fp8rl_core.tasks.arithmetic import ArithmeticTask, corrupt_digit

    rnd = random.Random(0)
    for answer in ["0", "7", "168", "-45", "-5"]:
        for _ in range(20):
            bad = corrupt_digit(answer, rnd)
            assert len(bad) == len(answer) and bad != answer
            assert sum(a != b for a, b in zip(answer, bad)) == 1 and bad[0] != "-" or answer[0] == "-"
    clean = ArithmeticTask(digits=2, val_size=16, warmstart_label_noise=0.0).warmstart_sample(random.Random(1), 200)
    noisy_task = ArithmeticTask(digits=2, val_size=16, warmstart_label_noise=0.5)
    noisy = noisy_task.warmstart_sample(random.Random(1), 400)
    truth = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}
    wrong = sum(str(truth[op](int(a), int(b))) != ex.answer
                for ex in noisy for op in "+-" if op in ex.prompt[1:]
                for a, b in [ex.prompt[:-1].rsplit(op, 1)])
    assert all(noisy_task.reward(ex, ex.answer) == 1.0 for ex in clean)
    assert 0.4 < wrong / len(noisy) < 0.6  # about half the targets corrupted


# ---- the scratchpad variant (task.scratchpad) -----------------------------------------------------------
def _parse_worked(text: str) -> tuple[list[tuple[int, str, int, int]], int]:
    """Independent reading of a worked completion: [(x, op, y, z) for each 'x<op>y=z'], final answer."""
    work, _, answer = text.rpartition(":")
    steps = []
    for part in work.split(";"):
        m = re.fullmatch(r"(-?\d+)([+-])(-?\d+)=(-?\d+)", part)
        assert m, f"malformed step {part!r} in {text!r}"
        steps.append((int(m[1]), m[2], int(m[3]), int(m[4])))
    return steps, int(answer)


def test_scratchpad_work_is_correct_arithmetic_ending_in_the_answer():
    """Every step of the work is true arithmetic, the place-value parts sum to the result, and the text
    after the last ':' is the answer, over many random prompts of every digit count."""
    from fp8rl_core.tasks.arithmetic import worked

    task = ArithmeticTask(digits=3, scratchpad=True, val_size=16)
    for ex in task.sample_train(random.Random(5), 400):
        steps, answer = _parse_worked(worked(ex.prompt))
        assert answer == int(ex.answer)
        for x, op, y, z in steps:
            assert z == (x + y if op == "+" else x - y)
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", ex.prompt).groups()
        n = max(len(a), len(b))
        parts = steps[:n]  # one per place value, most significant first
        assert [x for x, _, _, _ in parts] == [int(a) // 10**i % 10 * 10**i for i in reversed(range(n))]
        assert sum(z for _, _, _, z in parts) == answer


def test_scratchpad_reward_reads_the_final_answer_and_sft_targets_the_work():
    task = ArithmeticTask(digits=2, scratchpad=True, val_size=16)
    ex = Example("37-59=", "-22")
    assert task.sft_text(ex) == ("37-59=", "30-50=-20;7-9=-2;-20+-2=-22:-22")
    assert task.reward(ex, "30-50=-20;7-9=-2;-20+-2=-22:-22") == 1.0
    assert task.reward(ex, "garbage:-22") == 1.0  # the work is not graded
    assert task.reward(ex, "30-50=-20;7-9=-2;-20+-2=-22:-21") == 0.0
    assert task.reward(ex, "-22") == 1.0 and task.reward(ex, "") == 0.0
    plain = ArithmeticTask(digits=2, val_size=16)
    assert plain.sft_text(ex) == ("37-59=", "-22") and plain.reward(ex, "x:-22") == 0.0
    assert set(";:+") <= set(task.alphabet())


def test_scratchpad_refuses_multiplication():
    with pytest.raises(ValueError, match="task.scratchpad"):
        ArithmeticTask(digits=2, operators=("+", "*"), scratchpad=True, val_size=16)
