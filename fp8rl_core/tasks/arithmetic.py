"""The default task: integer arithmetic with an exact-match reward, e.g. "123+45=" -> "168", "7-12=" -> "-5".

Distribution: an operator uniformly from `operators`; each operand gets a digit count uniformly in
[min_digits, digits], then a value uniformly among the numbers with exactly that many digits (1 digit:
0-9). Short operands are therefore common (an easy part) and long ones rare per prompt (a hard part),
which spreads difficulty. The validation set is `val_size` distinct prompts of this distribution, drawn
with `data_seed`; training and warm-start sampling reject those prompts, so they are never trained on.

Warm start (docs/design.md: a tiny Llama trained on 1-2-digit addition reaches 97.5% in 600 steps, far too
easy): `warmstart_sample` draws operands of at most `warmstart_digits` digits, except for a
`warmstart_full_fraction` of examples drawn from the RL distribution. E.g. digits=3, warmstart_digits=2,
warmstart_full_fraction=0.05 leaves the 3-digit operands mostly unseen before RL: the policy starts with
a non-zero reward (the short-operand prompts) and room to climb (the long ones).

Scratchpad (`task.scratchpad`, an option for longer responses): the completion works the sum out by
place value before the answer, most significant place first, then adds the partial results up, e.g.
"37-59=" -> "30-50=-20;7-9=-2;-20+-2=-22:-22" (27 tokens instead of 3). The reward is the exact match
of the text after the last ":" (the work itself is not graded, as GSM8K-style rewards grade the final
answer only); the warm start is supervised on the whole worked completion. + and - only.

Label noise (an option; the default study uses a clean warm start and samples at T=2 instead, see
README "The task and the warm start"): `warmstart_label_noise` is the probability that a warm-start
target has one digit replaced by another digit, as in noisy human demonstrations. The warm-started
policy then knows the answer more often than it samples it, so pass@1 starts below its greedy
accuracy; measured at T=1 (5000 warm-start steps, noise 0.3): pass@1 34% -> 47% in 700 RL steps,
then it stalls near the greedy accuracy (~52%).
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from fp8rl_core.tasks.base import Example, Rng, Task, as_random, exact_match

OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_MAX_TRIES_PER_EXAMPLE = 200  # rejection sampling: each draw hits a validation prompt with small probability


def _operand_count(lo: int, hi: int) -> int:
    """How many distinct operands have lo..hi digits (1 digit includes 0)."""
    return 10**hi - (10 ** (lo - 1) if lo > 1 else 0)


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(self, digits: int = 3, min_digits: int = 1, operators: Sequence[str] = ("+", "-"),
                 val_size: int = 128, data_seed: int = 1234, warmstart_digits: int | None = None,
                 warmstart_full_fraction: float = 0.0, warmstart_label_noise: float = 0.0,
                 scratchpad: bool = False):
        if not 1 <= min_digits <= digits <= 9:
            raise ValueError(f"task.digits: need 1 <= min_digits <= digits <= 9, got {min_digits}..{digits}")
        bad = [op for op in operators if op not in OPERATORS]
        if bad or not operators:
            raise ValueError(f"task.operators: {bad or 'empty'} not allowed; valid: {', '.join(OPERATORS)}")
        wd = digits if warmstart_digits is None else warmstart_digits
        if not min_digits <= wd <= digits:
            raise ValueError(f"task.warmstart_digits: need min_digits ({min_digits}) <= warmstart_digits "
                             f"<= digits ({digits}), got {wd}")
        if not 0.0 <= warmstart_full_fraction <= 1.0:
            raise ValueError(f"task.warmstart_full_fraction: must be in [0, 1], got {warmstart_full_fraction}")
        space = _operand_count(min_digits, digits) ** 2 * len(set(operators))
        if not 1 <= val_size <= space // 4:
            raise ValueError(f"task.val_size: {val_size} held-out prompts of {space} possible; need "
                             f"1 <= val_size <= {space // 4} so that most prompts stay for training")
        self.digits, self.min_digits, self.operators = digits, min_digits, tuple(operators)
        if not 0.0 <= warmstart_label_noise <= 1.0:
            raise ValueError(f"task.warmstart_label_noise: must be in [0, 1], got {warmstart_label_noise}")
        self.warmstart_digits, self.warmstart_full_fraction = wd, warmstart_full_fraction
        self.warmstart_label_noise = warmstart_label_noise
        if scratchpad and "*" in self.operators:
            raise ValueError("task.scratchpad: worked completions cover + and - only; drop '*' from task.operators")
        self.scratchpad = scratchpad
        self.data_seed = data_seed
        self.val_examples = self._make_val(val_size, random.Random(data_seed))
        self._val_prompts = frozenset(e.prompt for e in self.val_examples)

    def alphabet(self) -> str:
        extra = ";:+" if self.scratchpad else ""  # the work adds partial results with "+"
        return "".join(sorted(set("0123456789=" + extra) | set(self.operators)))  # "-" results only come from "-"

    def sft_text(self, example: Example) -> tuple[str, str]:
        if not self.scratchpad:
            return example.prompt, example.answer
        return example.prompt, worked(example.prompt)

    def reward(self, example: Example, completion: str) -> float:
        """Exact match of the answer; with a scratchpad, of the text after the completion's last ":"."""
        return exact_match(example.answer, completion.rpartition(":")[2] if self.scratchpad else completion)

    def _operand(self, rnd: random.Random, hi: int) -> int:
        k = rnd.randint(self.min_digits, hi)
        return rnd.randint(0 if k == 1 else 10 ** (k - 1), 10**k - 1)

    def _draw(self, rnd: random.Random, hi: int) -> Example:
        op = rnd.choice(self.operators)
        a, b = self._operand(rnd, hi), self._operand(rnd, hi)
        return Example(f"{a}{op}{b}=", str(OPERATORS[op](a, b)))

    def _make_val(self, n: int, rnd: random.Random) -> list[Example]:
        seen: dict[str, Example] = {}
        for _ in range(n * _MAX_TRIES_PER_EXAMPLE):
            ex = self._draw(rnd, self.digits)
            seen.setdefault(ex.prompt, ex)
            if len(seen) == n:
                return list(seen.values())
        raise ValueError(f"task.val_size: could not draw {n} distinct prompts; lower val_size")

    def _draw_train(self, rnd: random.Random, hi: int) -> Example:
        for _ in range(_MAX_TRIES_PER_EXAMPLE):
            ex = self._draw(rnd, hi)
            if ex.prompt not in self._val_prompts:
                return ex
        raise RuntimeError(f"operands of <= {hi} digits are (almost) all validation prompts; "
                           "raise task.warmstart_digits or lower task.val_size")

    def sample_train(self, rng: Rng, n: int) -> list[Example]:
        rnd = as_random(rng)
        return [self._draw_train(rnd, self.digits) for _ in range(n)]

    def warmstart_sample(self, rng: Rng, n: int) -> list[Example]:
        rnd = as_random(rng)
        out = []
        for _ in range(n):
            # draw the coin flips only for knobs in use, so that without them this is sample_train
            full = self.warmstart_digits == self.digits or rnd.random() < self.warmstart_full_fraction
            ex = self._draw_train(rnd, self.digits if full else self.warmstart_digits)
            if self.warmstart_label_noise > 0 and rnd.random() < self.warmstart_label_noise:
                ex = Example(ex.prompt, corrupt_digit(ex.answer, rnd))
            out.append(ex)
        return out


def worked(prompt: str) -> str:
    """The scratchpad completion of an "a+b=" / "a-b=" prompt (see the module docstring).

    With n = the longer operand's digit count and x_i = x's digit at place i times 10^i: the parts
    "a_i op b_i = p_i" for i = n-1 .. 0, then the running sums "s + p_i = s'", then ":" and the answer."""
    body = prompt.rstrip("=")
    op = next(c for c in body[1:] if c in "+-")  # the operator (a leading "-" would be a sign; operands are >= 0)
    a_text, b_text = body.split(op, 1)
    a, b = int(a_text), int(b_text)
    n = max(len(a_text), len(b_text))
    parts, values = [], []
    for i in reversed(range(n)):
        da, db = a // 10**i % 10 * 10**i, b // 10**i % 10 * 10**i
        values.append(OPERATORS[op](da, db))
        parts.append(f"{da}{op}{db}={values[-1]}")
    total = values[0]
    for v in values[1:]:
        parts.append(f"{total}+{v}={total + v}")
        total += v
    return ";".join(parts) + f":{total}"


def corrupt_digit(answer: str, rnd: random.Random) -> str:
    """`answer` with one of its digits replaced by a different digit, e.g. "168" -> "148"."""
    positions = [i for i, c in enumerate(answer) if c.isdigit()]
    i = rnd.choice(positions)
    new = rnd.choice([d for d in "0123456789" if d != answer[i]])
    return answer[:i] + new + answer[i + 1:]
