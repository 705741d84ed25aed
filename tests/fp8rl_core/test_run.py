"""The single run: it learns signal end to end, and a resumed run is bit-identical to an uninterrupted one."""
import json

import pytest

from fp8rl_core.config import load_run_config
from fp8rl_core.run import run


def _is_timing(key: str) -> bool:
    """Wall-clock metrics differ run to run; everything else must match bit for bit."""
    return key.endswith("time_s") or key.endswith("per_s")


def _tiny(tmp_path, name, *extra):
    return load_run_config(None, [
        f"output_dir={tmp_path / name}", f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.steps=10",
        "warmstart.batch_size=16", "train.steps=4", "train.val_every=2", "train.checkpoint_every=2",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=3", "rollout.max_new_tokens=5",
        "task.val_size=6", "threads=1", *extra])


def _metrics(path):
    out = {}
    for line in (path / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "metrics":
            vals = {k: v for k, v in rec["values"].items() if not _is_timing(k)}
            out.setdefault(rec["step"], {}).update(vals)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
def test_resume_is_bit_identical(tmp_path, recipe):
    extra = [f"recipe={recipe}", "loss.importance_sampling=tis", "optim.micro_steps=2"]
    straight = _tiny(tmp_path, "straight", *extra)
    run(straight, progress=False)
    interrupted = _tiny(tmp_path, "interrupted", *extra)
    run(interrupted, progress=False, stop_after=3)  # checkpoint at 2, then stop at 3 (checkpointed too)
    run(interrupted, progress=False)
    a, b = _metrics(tmp_path / "straight"), _metrics(tmp_path / "interrupted")
    assert sorted(a) == [0, 1, 2, 3, 4]
    assert a == b  # every metric of every step, exactly (floats compared bit for bit via JSON)


def test_bad_override_is_rejected_before_any_work(tmp_path):
    from fp8rl_core.cli import main

    assert main(["recipe=fp16", f"output_dir={tmp_path / 'x'}"]) == 2
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_crash_between_checkpoints_resumes_without_duplicates(tmp_path, monkeypatch):
    """Killed after step 3 (last checkpoint: 2): the restart redoes step 3 and logs it once."""
    import fp8rl_core.run as run_mod

    straight = _tiny(tmp_path, "straight")
    run(straight, progress=False)
    crashed = _tiny(tmp_path, "crashed")
    real_step, calls = run_mod.grpo_step, []

    def dying_step(ctx):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt("node lost")
        return real_step(ctx)

    monkeypatch.setattr(run_mod, "grpo_step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        run(crashed, progress=False)
    monkeypatch.setattr(run_mod, "grpo_step", real_step)
    run(crashed, progress=False)
    steps = [json.loads(x)["step"] for x in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x).get("kind") == "metrics"]
    assert sorted(steps) == sorted(set(steps)) == [0, 1, 2, 3, 4]
    assert _metrics(tmp_path / "crashed") == _metrics(tmp_path / "straight")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "fp8_e2e"])
def test_reused_old_logprobs_equal_the_two_pass_run(tmp_path, recipe):
    """micro_steps 1: taking the old log-probs from the training forward (one pass) instead of a separate
    no-grad pass changes no metric of any step, bit for bit (same weights, same kernels on this CPU)."""
    extra = [f"recipe={recipe}", "loss.importance_sampling=tis", "optim.micro_steps=1"]
    run(_tiny(tmp_path, "one_pass", *extra, "train.reuse_old_logprobs=true"), progress=False)
    run(_tiny(tmp_path, "two_pass", *extra, "train.reuse_old_logprobs=false"), progress=False)
    a, b = _metrics(tmp_path / "one_pass"), _metrics(tmp_path / "two_pass")
    assert sorted(a) == [0, 1, 2, 3, 4] and a == b
