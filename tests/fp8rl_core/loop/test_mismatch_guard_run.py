"""The mismatch guard end to end: the run's builder hands it to the trainer, every step logs its metrics,
and each step it acts on gets a line in the run's log naming the step and why. fp8_gen: FP8 generation
against a BF16 trainer, a mismatch well above 1 on every sequence (so a band ending at 1 + 1e-6 catches it)."""
from __future__ import annotations

import json
import logging
import math

import pytest

from fp8rl_core.config import load_run_config
from fp8rl_core.engines.guard import guard_note
from fp8rl_core.loop.run import run

G = "train.mismatch_guard"
STEPS = 2


def _tiny(tmp_path, *extra):
    return load_run_config(None, [
        f"output_dir={tmp_path / 'run'}", f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.steps=10",
        "warmstart.batch_size=16", f"train.steps={STEPS}", f"train.val_every={STEPS}",
        f"train.checkpoint_every={STEPS}", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=3",
        "rollout.max_new_tokens=5", "task.val_size=6", "threads=1", "recipe=fp8_gen", *extra])


def _steps(path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (path / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "metrics" and rec["step"] > 0:
            out.setdefault(rec["step"], {}).update(rec["values"])
    return out


@pytest.mark.parametrize("extra, reason", [
    # several optimizer steps per rollout batch: each is guarded by the step's mismatch (the logged one)
    ([f"{G}.action=skip", "optim.micro_steps=2"], "guard_skip_mismatch"),
    # one optimizer step, old log-probs from its own forward: every sequence masked, nothing to learn from
    ([f"{G}.action=mask"], "guard_skip_all_masked"),
])
def test_every_step_logs_the_guard_and_a_line_when_it_acts(tmp_path, caplog, extra, reason):
    cfg = _tiny(tmp_path, f"{G}.max_mismatch=1.000001", *extra)
    with caplog.at_level(logging.WARNING, logger="fp8rl_core.loop.run"):
        run(cfg, progress=False)
    steps = _steps(tmp_path / "run")
    assert sorted(steps) == list(range(1, STEPS + 1))
    lines = [r.getMessage() for r in caplog.records if "mismatch guard" in r.getMessage()]
    assert len(lines) == STEPS
    for step, m in steps.items():
        assert m["token_mult_prob_error"] > 1.000001
        assert m["guard_skipped"] == 1.0 and m[reason] == 1.0
        assert m["guard_mismatch"] == pytest.approx(m["token_mult_prob_error"], rel=1e-12)
        line = lines[step - 1]
        assert line.startswith(f"step {step}: mismatch guard ") and "max_mismatch 1.000001" in line


def test_the_log_line_says_what_the_guard_did_and_why():
    spec = load_run_config(None, [f"{G}.action=mask", f"{G}.max_mismatch=1.2", f"{G}.max_grad_norm=50"]
                           ).train.mismatch_guard
    quiet = {"guard_skipped": 0.0, "guard_masked_fraction": 0.0}
    assert guard_note(quiet, spec) is None
    masked = guard_note({**quiet, "guard_masked_fraction": 0.25, "guard_sequence_mismatch_max": 3.5}, spec)
    assert masked == ("mismatch guard masked 25.0% of the sequences (token_mult_prob_error per sequence > "
                      "max_mismatch 1.2; the largest 3.5)")
    spike = guard_note({**quiet, "guard_skipped": 1.0, "guard_skip_grad_norm": 1.0, "grad_norm": 53651.0,
                        "guard_mismatch": math.nan}, spec)
    assert spike == "mismatch guard skipped the update: gradient norm 53651 > max_grad_norm 50.0"
    half = guard_note({**quiet, "guard_skipped": 0.5, "guard_skip_mismatch": 0.5, "guard_mismatch": 2659.0}, spec)
    assert half == ("mismatch guard skipped the update (50% of its optimizer steps): token_mult_prob_error 2659 > "
                    "max_mismatch 1.2")
