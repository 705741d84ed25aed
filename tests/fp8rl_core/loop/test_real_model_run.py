"""A real model end to end: SmolLM2-135M-Instruct (the packaged GGUF) on a reasoning-gym task, one GRPO
step per recipe through the loop the study runs (chat-templated prompts, the dataset's scorer, both engines
on the dequantized weights): the loss is finite and the mismatch metrics are logged."""
from __future__ import annotations

import importlib.util
import json
import math

import pytest

if importlib.util.find_spec("reasoning_gym") is None:  # the README's test command installs it: fail, never skip
    pytest.fail("reasoning_gym is not installed: bash scripts/setup_real_model.sh (scripts/test.sh runs it)",
                pytrace=False)

from fp8rl_core.config import load_run_config  # noqa: E402
from fp8rl_core.loop.run import run  # noqa: E402


def _metrics(out) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "metrics":
            steps.setdefault(rec["step"], {}).update(rec["values"])
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
def test_one_grpo_step_on_smollm2(tmp_path, smollm2, recipe):
    spec, folder = smollm2
    cfg = load_run_config(None, [
        f"model.path={spec}", "task.name=reasoning_gym", "task.dataset=basic_arithmetic",
        "task.options={min_terms: 2, max_terms: 2, max_digits: 2, operators: ['+', '-'], "
        "allow_parentheses: false, allow_negation: false}", "task.val_size=2", "task.train_size=20",
        f"recipe={recipe}", "train.steps=1", "train.val_every=1", "train.val_samples=1",
        "rollout.prompts_per_step=1", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=6",
        "rollout.temperature=1.0", "threads=1", f"output_dir={tmp_path / recipe}"])
    run(cfg, progress=False)
    steps = _metrics(tmp_path / recipe)
    one = steps[1]
    assert math.isfinite(one["loss"]) and math.isfinite(one["grad_norm"])
    # the two engines ran the same real model: the mismatch is logged, finite and near 1 (not a broken
    # weight load, which would put it orders of magnitude away)
    assert 0.9 < one["token_mult_prob_error"] < 1.5, one["token_mult_prob_error"]
    assert math.isfinite(one["gen_kl_error"]) and one["num_valid_tokens"] > 0
    assert 0.0 <= steps[0]["val_accuracy"] <= 1.0  # pass@1 through the BF16 evaluation engine at step 0
    assert (folder / "tokenizer.json").is_file()
