"""One run (one sweep cell): warm start -> GRPO steps -> metrics, with atomic checkpoints and resume.

    cfg = load_run_config("cfg.yaml", ["recipe=fp8_e2e", "loss.importance_sampling=token"])
    summary = run(cfg)

A restarted run (requeue, preemption, crash) resumes from `<output_dir>/checkpoints` and produces
the same metrics, bit for bit, as an uninterrupted one: weights, optimizer, step, prompt-sampling
RNG, sampling generator and minibatch-shuffle generator are all in the checkpoint.

On several ranks (`torchrun --nproc-per-node N -m fp8rl_core.cli ...`, multi-task SLURM) every rank
runs this loop; rank 0 alone writes metrics/MLflow (the others log into a NullSink) and writes
diagnostics; every rank validates its share of the held-out batches (loop/evaluate.py) and checkpoints.
The world size is an MLflow tag (`world_size`).
"""
from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from fp8rl_core.config import RunConfig, run_config_hash, val_batch_rows
from fp8rl_core.config.schema import flatten
from fp8rl_core.diagnostics.tokens import after_step
from fp8rl_core.distributed import shutdown
from fp8rl_core.engines import base as engines
from fp8rl_core.engines.guard import guard_note
from fp8rl_core.engines.kv_quant import KVScales
from fp8rl_core.fp8.preflight import PreflightError, metrics_from_params
from fp8rl_core.fp8.quant import check_nonfinite
from fp8rl_core.io import checkpoint as ckpt
from fp8rl_core.loop.builder import build_context
from fp8rl_core.loop.context import RunContext
from fp8rl_core.loop.evaluate import validation_metrics
from fp8rl_core.loop.hold import hold_after
from fp8rl_core.loop.preempt import TimeLimit
from fp8rl_core.loop.step import grpo_step, held_kv_scales, sampling_params
from fp8rl_core.tracking import M_MISMATCH, M_REWARD, M_VAL_ACC, M_VAL_ACC_BF16_EVAL, TAG_BF16_COMPUTE, TAG_WORLD_SIZE
from fp8rl_core.tracking.lifecycle import PAUSED, run_status
from fp8rl_core.tracking.sink import NullSink, make_run_sink, run_params

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """The run cannot go on (non-finite loss or gradient, ...); the message says why and where."""


def _capture(ctx: RunContext, step: int) -> dict[str, Any]:
    """This rank's non-tensor state: prompt-sampling RNG, minibatch shuffle, sampler, torch RNG.
    (Model, optimizer and engine step go through DCP: ckpt.EngineState.)"""
    state = {"step": step, "data_rng": ctx.data_rng.getstate(), "shuffle": ctx.shuffle.get_state(),
             "gen_rng": ctx.gen.generator.get_state(), "torch_rng": torch.get_rng_state(),
             "bf16_compute": ctx.numerics.get(TAG_BF16_COMPUTE, "")}
    scales = held_kv_scales(ctx)
    if scales is not None:  # computed on a batch (the step's, the first prefill's) a resume no longer has
        state["kv_scales"] = {"k": scales.k, "v": scales.v, "step": scales.step, "amax_k": scales.amax_k,
                              "amax_v": scales.amax_v}
    return state


def _restore(ctx: RunContext, rank_state: dict[str, Any], own: bool = True) -> int:
    """Restore this rank's RNG/data state; refit the generation engine. Returns the finished steps.

    own=False (a rank the checkpoint's world size did not have): only the state every rank shares
    (prompt sampling, torch RNG) is taken from rank 0; this rank's sampler and shuffle streams stay
    as freshly seeded — a resharded resume is statistically, not bitwise, the same run.
    """
    _warn_on_path_switch(ctx, rank_state.get("bf16_compute"))
    ctx.data_rng.setstate(_as_tuple(rank_state["data_rng"]))
    torch.set_rng_state(rank_state["torch_rng"])
    if own:
        ctx.shuffle.set_state(rank_state["shuffle"])
        ctx.gen.generator.set_state(rank_state["gen_rng"])
    ctx.weights_step = int(rank_state["step"])
    kept = rank_state.get("kv_scales")  # the KV scales the run had for these weights (kv_scale trainer, first_forward)
    ctx.refit_generation(kv_scales=None if kept is None else KVScales(
        kept["k"], kept["v"], int(kept["step"]), kept.get("amax_k"), kept.get("amax_v")))
    return int(rank_state["step"])


def _warn_on_path_switch(ctx: RunContext, before: str | None) -> None:
    """A resume on a machine that resolves model.bf16_compute to the other path: same numerics by
    definition (summation order aside), so it goes on, but says so (the attempt's tag records it)."""
    now = ctx.numerics.get(TAG_BF16_COMPUTE, "")
    if before and now and before != now and ctx.mesh.is_rank0:
        warnings.warn(f"{ctx.cfg.output_dir}: resuming with BF16 path {now!r}, the checkpoint was written with "
                      f"{before!r} (model.bf16_compute={ctx.cfg.model.bf16_compute!r} on another CPU kind?); the "
                      "results stay BF16 but their summation order changes from here on", stacklevel=2)


def _as_tuple(x: Any) -> Any:
    """random.Random.setstate needs tuples; a checkpoint may hand lists back."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _validate(ctx: RunContext) -> dict[str, float]:
    """Collective: every rank validates its share and returns the same global metrics (loop/evaluate.py:
    batches dealt over the ranks, rewards all-reduced). Validation on the arm's own generation engine, and
    `val_accuracy_bf16_eval`: the same prompts and sampling seeds through the BF16 engine (the arm's own for a
    BF16-generating recipe under native generation; under vLLM the native BF16 evaluator for every recipe,
    engines/bf16_eval.py). On every rank the arm's engine is held awake over its batches and then sleeps at
    level 1 (its weights serve the next rollout); only then is the BF16 engine refit (a collective: from
    sharded weights an all-gather per tensor), so the two never hold the GPU together; after its batches it
    sleeps at level 2 (its next use follows a refit)."""
    cfg = ctx.cfg
    sampling, samples, rows = sampling_params(cfg), cfg.train.val_samples, val_batch_rows(cfg)
    with engines.awake(ctx.gen):  # many generate calls on one set of weights; the next rollout uses them too
        out = validation_metrics(ctx.gen, ctx.tokenizer, ctx.task, sampling, samples, batch_size=rows, mesh=ctx.mesh)
    if ctx.bf16_gen is None:  # the arm's own engine is the BF16 one (RunContext.bf16_engine)
        out[M_VAL_ACC_BF16_EVAL] = out[M_VAL_ACC]
        return out
    engines.sleep(ctx.gen, level=1)  # keep its weights (host) for the next rollout: no refit before it
    neutral_engine = ctx.bf16_engine()  # refit now, on the GPU the arm's engine gave back
    with engines.awake(neutral_engine):
        neutral = validation_metrics(neutral_engine, ctx.tokenizer, ctx.task, sampling, samples, batch_size=rows,
                                     greedy=False, mesh=ctx.mesh)
    out[M_VAL_ACC_BF16_EVAL] = neutral[M_VAL_ACC]
    engines.sleep(neutral_engine, level=2)
    return out


def _is_val_step(cfg: RunConfig, step: int) -> bool:
    return step == 0 or step % cfg.train.val_every == 0 or step == cfg.train.steps


def _model_config(ctx: RunContext) -> dict[str, Any] | None:
    cfg = getattr(getattr(ctx.train, "model", None), "config", None)
    return cfg.to_hf_dict() if hasattr(cfg, "to_hf_dict") else None


def _checkpoint(ctx: RunContext, ckpt_dir: Path, step: int) -> None:
    """Collective: every rank writes its shards and its RNG state (fp8rl_core/io/checkpoint.py)."""
    ckpt.save_checkpoint(ckpt_dir, step, {ckpt.TRAIN_KEY: ckpt.EngineState(ctx.train)}, _capture(ctx, step),
                         meta={"cell_id": run_config_hash(ctx.cfg), "recipe": ctx.cfg.recipe},
                         model_config=_model_config(ctx))


def resume_or_start(ctx: RunContext, ckpt_dir: Path) -> int:
    """Restore the newest checkpoint if any (at any saved world size); returns the finished steps."""
    found = ckpt.latest_checkpoint(ckpt_dir)
    if found is None:
        return 0
    if ckpt.is_legacy(found):
        return _restore_legacy(ctx, found)
    ckpt.load_checkpoint(found, {ckpt.TRAIN_KEY: ckpt.EngineState(ctx.train)})
    own = ckpt.read_rank_state(found)
    return _restore(ctx, own if own is not None else ckpt.read_rank_state(found, rank=0), own=own is not None)


def _restore_legacy(ctx: RunContext, found: Path) -> int:
    """A pre-DCP checkpoint (weights.safetensors + state.pt): one process only."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        raise RunFailed(f"{found}: a pre-DCP checkpoint resumes at world size 1 only; resume there once "
                        "(its next checkpoint is DCP) or start the run afresh")
    _, state, _ = ckpt.load_legacy(found)
    ctx.train.load_state_dict(state["train"])
    return _restore(ctx, state)


def run(cfg: RunConfig, progress: bool = True, stop_after: int | None = None) -> dict[str, float]:
    """Run (or resume) the GRPO run described by `cfg`. Returns the last step's metrics.

    stop_after: end (after checkpointing) once this many steps are done — for tests of resume.
    """
    out_dir = Path(cfg.output_dir)
    ckpt_dir = out_dir / "checkpoints"
    try:
        ctx = build_context(cfg, progress=progress)
    except PreflightError as e:  # a GEMM shape failed before any engine or FP8 step (fp8/preflight.py)
        raise RunFailed(str(e)) from e
    clean = False
    try:
        metrics = _run_steps(ctx, out_dir, ckpt_dir, progress, stop_after)
        clean = True
        return metrics
    finally:
        shutdown(ctx.mesh, clean=clean)



def _end_of_step(ctx: RunContext, ckpt_dir: Path, step: int, limit: TimeLimit) -> None:
    """The periodic checkpoint, the test hold, and the time limit's checkpoint and requeue (which exits)."""
    cfg = ctx.cfg
    periodic = step % cfg.train.checkpoint_every == 0 or step == cfg.train.steps
    if periodic:
        _checkpoint(ctx, ckpt_dir, step)
    hold_after(step, until=lambda: limit.requested)  # test hook (FP8RL_HOLD_AFTER_STEP), ended by the signal
    if step < cfg.train.steps:  # after the last step the run is done: it ends as usual, nothing to resume
        limit.stop_here(step, lambda s: _checkpoint(ctx, ckpt_dir, s), checkpointed=periodic)


def _run_steps(ctx: RunContext, out_dir: Path, ckpt_dir: Path, progress: bool, stop_after: int | None
               ) -> dict[str, float]:
    """The step loop of `run` on one rank (all ranks run it and validate their share; rank 0 alone logs)."""
    cfg, rank0 = ctx.cfg, ctx.mesh.is_rank0
    done = resume_or_start(ctx, ckpt_dir)  # collective: every rank loads its shards
    sink = make_run_sink(cfg, out_dir, resume_step=done) if rank0 else NullSink()
    if done == 0 and not cfg.tracking.run_id:  # a sweep cell's params: its driver logged them with its run
        sink.log_params(flatten(run_params(cfg)))
    # tags, not params: a resumed run may reshard, or run on another CPU kind (per attempt)
    sink.set_tags({TAG_WORLD_SIZE: ctx.mesh.world_size, **ctx.numerics})
    # the FP8 GEMM preflight (builder) as metrics at step 0; a resumed attempt's own is in its tags only
    if done == 0 and (preflight := metrics_from_params(ctx.numerics)):
        sink.log(0, preflight)
    last: dict[str, float] = {}
    bar = tqdm(total=cfg.train.steps, initial=done, desc=f"{cfg.recipe}/IS={cfg.loss.importance_sampling}"
               f"/seed={cfg.seed}", disable=not (progress and rank0), mininterval=1.0)
    limit = TimeLimit(ctx.mesh).__enter__()  # USR2 (time limit, preemption): checkpoint at a step's end
    try:
        if done == 0:
            sink.log(0, _validate(ctx))
        for step in range(done + 1, cfg.train.steps + 1):
            try:
                result = grpo_step(ctx)
            except FloatingPointError as e:
                check_nonfinite()  # on CUDA the quantizer's NaN/inf check is deferred: it names the tensor
                raise RunFailed(f"step {step}: {e}") from e
            check_nonfinite()  # the deferred check's one GPU->CPU sync per step (fp8/quant.py); nothing on a CPU
            last = result.metrics
            if rank0 and (note := guard_note(last, cfg.train.mismatch_guard)):
                log.warning("step %d: %s", step, note)  # the run's stderr log, beside its metrics
            if _is_val_step(cfg, step):
                last.update(_validate(ctx))
            sink.log(step, last)
            if rank0:
                # worst-token table, rollout for `explain` (fp8rl_core/diagnostics), from this step's batch
                after_step(cfg, ctx.tokenizer, ctx.gen.config, result.batch, sink, step, result.kv_scales)
            bar.update(1)
            bar.set_postfix(reward=f"{last[M_REWARD]:.2f}", mismatch=f"{last[M_MISMATCH]:.4f}",
                            val=f"{last.get(M_VAL_ACC, float('nan')):.2f}", refresh=False)
            _end_of_step(ctx, ckpt_dir, step, limit)
            if stop_after is not None and step >= stop_after:
                if step % cfg.train.checkpoint_every:
                    _checkpoint(ctx, ckpt_dir, step)
                status = PAUSED  # stopped on purpose: the run goes on in a later call
                return last
        status = run_status(None)
        return last
    except BaseException as e:  # a requeue stays RUNNING, a cancel is KILLED, an error FAILED (one table)
        status = run_status(e)
        raise
    finally:
        limit.__exit__()
        bar.close()
        sink.close(status)
