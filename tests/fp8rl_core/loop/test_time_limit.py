"""The time-limit signal (USR2): the run checkpoints the step it is in before the requeue takes it
(fp8rl_core/loop/preempt.py), so a requeued run loses no step (issue 31, M7)."""
from __future__ import annotations

import json
import os
import signal

import pytest

from fp8rl_core.config import load_run_config
from fp8rl_core.distributed.mesh import SINGLE
from fp8rl_core.io.checkpoint import latest_checkpoint
from fp8rl_core.loop.preempt import SIGNAL, TimeLimit
from fp8rl_core.loop.run import run


def _tiny(tmp_path, name):
    # checkpoint_every 100: no periodic checkpoint before the last step, so only the signal's can exist
    return load_run_config(None, [
        f"output_dir={tmp_path / name}", f"warmstart.cache_dir={tmp_path / 'ws'}", "warmstart.steps=5",
        "warmstart.batch_size=8", "train.steps=4", "train.val_every=4", "train.checkpoint_every=100",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=4",
        "task.val_size=4", "threads=1"])


def _logged_steps(path):
    recs = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in recs if r.get("kind") == "metrics" and "loss" in r["values"]]


@pytest.fixture
def requeue_handler():
    """A stand-in for submitit's USR2 handler (checkpoint_and_try_requeue): records when it runs."""
    calls = []
    previous = signal.signal(SIGNAL, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(SIGNAL, previous)


@pytest.mark.slow
def test_the_signal_mid_step_checkpoints_that_step_before_the_requeue_and_the_resume_loses_none(
        tmp_path, monkeypatch, requeue_handler):
    import fp8rl_core.loop.run as run_mod

    cfg = _tiny(tmp_path, "cell")
    real_step, calls = run_mod.grpo_step, []

    def signalled_step(ctx):  # SLURM's USR2 arrives in the middle of step 2
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), SIGNAL)
        return real_step(ctx)

    monkeypatch.setattr(run_mod, "grpo_step", signalled_step)
    with pytest.raises(SystemExit):
        run(cfg, progress=False)
    found = latest_checkpoint(tmp_path / "cell" / "checkpoints")
    assert found is not None and found.name == "step_00000002"  # the step the signal arrived in, not one before
    assert requeue_handler == [SIGNAL]  # then the previous (submitit's) handler: once, after the checkpoint
    assert signal.getsignal(SIGNAL) is not None and len(calls) == 2  # no step after the signal's
    monkeypatch.setattr(run_mod, "grpo_step", real_step)
    run(cfg, progress=False)  # the requeued attempt
    assert sorted(_logged_steps(tmp_path / "cell")) == [1, 2, 3, 4]


def test_no_signal_no_stop_and_the_handler_is_restored(requeue_handler):
    before = signal.getsignal(SIGNAL)
    with TimeLimit(SINGLE) as limit:
        assert signal.getsignal(SIGNAL) is not before
        limit.stop_here(1, lambda s: pytest.fail("checkpointed without a signal"), checkpointed=False)
    assert signal.getsignal(SIGNAL) is before and requeue_handler == []


def test_a_periodic_checkpoint_of_the_step_is_not_written_twice(requeue_handler):
    written = []
    with TimeLimit(SINGLE) as limit:
        os.kill(os.getpid(), SIGNAL)
        assert limit.requested
        with pytest.raises(SystemExit, match="after step 3"):
            limit.stop_here(3, written.append, checkpointed=True)
    assert written == [] and requeue_handler == [SIGNAL]
