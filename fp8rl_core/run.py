"""One run (one sweep cell): warm start -> GRPO steps -> metrics, with atomic checkpoints and resume.

    cfg = load_run_config("cfg.yaml", ["recipe=fp8_e2e", "loss.importance_sampling=token"])
    summary = run(cfg)

A restarted run (requeue, preemption, crash) resumes from `<output_dir>/checkpoints` and produces
the same metrics, bit for bit, as an uninterrupted one: weights, optimizer, step, prompt-sampling
RNG, sampling generator and minibatch-shuffle generator are all in the checkpoint.
"""
from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fp8rl_core.builder import build_context
from fp8rl_core.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fp8rl_core.config import RunConfig, run_config_hash
from fp8rl_core.evaluate import validation_metrics
from fp8rl_core.grpo_step import RunContext, grpo_step, sampling_params
from fp8rl_core.hold import hold_after
from fp8rl_core.schema import flatten, to_dict
from fp8rl_core.tracking.sink import make_run_sink


class RunFailed(RuntimeError):
    """The run cannot go on (non-finite loss or gradient, ...); the message says why and where."""


def _capture(ctx: RunContext, step: int) -> dict[str, Any]:
    return {"step": step, "train": ctx.train.state_dict(), "data_rng": ctx.data_rng.getstate(),
            "shuffle": ctx.shuffle.get_state(), "gen_rng": ctx.gen.generator.get_state(),
            "torch_rng": torch.get_rng_state()}


def _restore(ctx: RunContext, weights: dict, state: dict) -> int:
    ctx.train.load_state_dict(state["train"])
    ctx.data_rng.setstate(_as_tuple(state["data_rng"]))
    ctx.shuffle.set_state(state["shuffle"])
    ctx.gen.generator.set_state(state["gen_rng"])
    torch.set_rng_state(state["torch_rng"])
    ctx.gen.refit(ctx.train.weights())
    return int(state["step"])


def _as_tuple(x: Any) -> Any:
    """random.Random.setstate needs tuples; a checkpoint may hand lists back."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _validate(ctx: RunContext) -> dict[str, float]:
    return validation_metrics(ctx.gen, ctx.tokenizer, ctx.task, sampling_params(ctx.cfg), ctx.cfg.train.val_samples)


def _is_val_step(cfg: RunConfig, step: int) -> bool:
    return step == 0 or step % cfg.train.val_every == 0 or step == cfg.train.steps


def _checkpoint(ctx: RunContext, ckpt_dir: Path, step: int) -> None:
    save_checkpoint(ckpt_dir, step, ctx.train.weights(), _capture(ctx, step),
                    meta={"cell_id": run_config_hash(ctx.cfg), "recipe": ctx.cfg.recipe})


def resume_or_start(ctx: RunContext, ckpt_dir: Path) -> int:
    """Restore the newest checkpoint if any; returns the number of finished steps."""
    found = latest_checkpoint(ckpt_dir)
    if found is None:
        return 0
    weights, state, _ = load_checkpoint(found)
    return _restore(ctx, weights, state)


def run(cfg: RunConfig, progress: bool = True, stop_after: int | None = None) -> dict[str, float]:
    """Run (or resume) the GRPO run described by `cfg`. Returns the last step's metrics.

    stop_after: end (after checkpointing) once this many steps are done — for tests of resume.
    """
    out_dir = Path(cfg.output_dir)
    ckpt_dir = out_dir / "checkpoints"
    ctx = build_context(cfg, progress=progress)
    done = resume_or_start(ctx, ckpt_dir)
    sink = make_run_sink(cfg, out_dir, resume_step=done)
    if done == 0:
        sink.log_params(flatten(to_dict(cfg)))
    last: dict[str, float] = {}
    bar = tqdm(total=cfg.train.steps, initial=done, desc=f"{cfg.recipe}/IS={cfg.loss.importance_sampling}"
               f"/seed={cfg.seed}", disable=not progress, mininterval=1.0)
    status = "FAILED"
    try:
        if done == 0:
            sink.log(0, _validate(ctx))
        for step in range(done + 1, cfg.train.steps + 1):
            try:
                last = grpo_step(ctx)
            except FloatingPointError as e:
                raise RunFailed(f"step {step}: {e}") from e
            if _is_val_step(cfg, step):
                last.update(_validate(ctx))
            sink.log(step, last)
            bar.update(1)
            bar.set_postfix(reward=f"{last['reward_mean']:.2f}", mismatch=f"{last['token_mult_prob_error']:.4f}",
                            val=f"{last.get('val_accuracy', float('nan')):.2f}", refresh=False)
            if step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps:
                _checkpoint(ctx, ckpt_dir, step)
            hold_after(step)  # test hook (FP8RL_HOLD_AFTER_STEP): a run held mid-flight on any machine
            if stop_after is not None and step >= stop_after:
                if step % cfg.train.checkpoint_every:
                    _checkpoint(ctx, ckpt_dir, step)
                status = "RUNNING"
                return last
        status = "FINISHED"
        return last
    except SystemExit:
        status = "RUNNING"  # submitit requeues (preemption/timeout): the run goes on in its next job
        raise
    except KeyboardInterrupt:
        status = "KILLED"  # stopped by hand; `sweep run` resumes it from its checkpoint
        raise
    finally:
        bar.close()
        sink.close(status)
