"""One GRPO step as the study runs it: generate -> score -> (mismatch, IS weights) -> train -> refit.

    1) sample P prompts, G generations each, from the generation engine (its own weight copy);
    2) rewards [P, G] -> leave-one-out advantages;
    3) the training engine scores the sampled tokens under the same weights that generated them
       (old log-probs): token_mult_prob_error(old, gen) is the engines' mismatch;
    4) importance weights w = f(old - gen) correct the policy gradient for that mismatch;
    5) `optim.micro_steps` optimizer steps on shuffled minibatches of the rollout batch;
    6) refit the generation engine from the updated trainer weights.

With `optim.micro_steps == 1` (and `train.reuse_old_logprobs`) step 3 is folded into step 5: the
training forward runs under the same weights that scored the batch, so its detached log-probs are the
old log-probs; IS weights are computed from them before the loss (ratio exp(lp - lp.detach()) = 1 with
the policy gradient) and one forward pass is saved.

With `engines.kernels: matched` step 3 replays the generation engine's own computation instead
(`NativeGenerationEngine.score`: the same kernels, batch shapes and decode order, the same quantized
weights) at the trainer's precision: the zero-mismatch floor. The gradient still comes from the
training forward, whose ratio to these old log-probs then carries the kernel difference.

Data parallel (world size W > 1, docs/design.md "Scale-out"): every rank draws the same P prompts from the
shared data RNG and keeps its P/W whole GRPO groups (rank r: prompts [r P/W, (r+1) P/W)), generates them
with its own engine and sampling stream, trains on them; loss and metrics are global and token-weighted.
What depends on the world size: the prompts of a step and their split do not; the sampled responses
do (rank r samples its rows from its own stream, builder.rank_seed; rank 0 starts from the run's seed
but draws fewer rows), so runs at W = 1 and W = 2 are statistically, not bitwise, alike. Given the
same global batch, the step is the same within FP32 tolerance (tests/fp8rl_core/distributed): the
old log-probs and the mismatch/IS metrics agree to float64 summation order, the loss to FP32
rounding, gradients to the rounding of per-rank partial sums.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from fp8rl_core.algorithms import grpo
from fp8rl_core.algorithms.importance import importance_from_config, importance_stats
from fp8rl_core.algorithms.metrics import token_mult_prob_error, token_mult_prob_error_sum
from fp8rl_core.config import RunConfig
from fp8rl_core.diagnostics.tokens import observe_step
from fp8rl_core.distributed.mesh import Mesh
from fp8rl_core.engines.base import GenerationOutput, SamplingParams, TrainBatch
from fp8rl_core.engines.kv_quant import KVScales
from fp8rl_core.fp8.gemm import executor_flags
from fp8rl_core.loop.context import RunContext
from fp8rl_core.loop.rollout import broadcast_advantages, build_train_batch, place_response_values, split_rows
from fp8rl_core.tracking import (
    M_IS_WEIGHT,
    M_KV_SCALE_CHECKSUM,
    M_KV_SCALE_STEP,
    M_MISMATCH,
    M_REWARD,
    M_STEP_TIME,
    M_TOKENS_PER_S,
)


@dataclass(frozen=True)
class StepResult:
    """What one grpo_step returns: its metrics (global over ranks; names per the MLflow contract in
    docs/design.md) and this rank's rollout batch (TrainBatch, with old_logprobs and is_weights filled),
    which the run loop hands to diagnostics.after_step (worst tokens, saved rollouts)."""

    metrics: dict[str, float]
    batch: TrainBatch
    # the per-layer KV scales the rollout was generated with (fp8.kv_cache e4m3, kv_scale trainer or
    # first_forward; else None), saved with the rollout so that `explain` refits its replay with them
    kv_scales: KVScales | None = None


def sampling_params(cfg: RunConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def _rollout(ctx: RunContext) -> tuple[list[list[int]], GenerationOutput, torch.Tensor, float]:
    """Generate this rank's share of the P x G responses. Returns (prompts [B], output, rewards
    [P/W, G], seconds); all ranks draw the same P prompts so the data stream does not depend on W."""
    P, G = ctx.cfg.rollout.prompts_per_step, ctx.cfg.rollout.samples_per_prompt
    examples = ctx.task.sample_train(ctx.data_rng, P)
    if ctx.mesh.distributed:
        examples = [examples[i] for i in ctx.mesh.shard(P, "rollout.prompts_per_step prompts")]
    prompts = [list(ids) for ex in examples for ids in [ctx.tokenizer.encode_prompt(ex.prompt)] * G]  # rendered once
    t0 = time.perf_counter()
    out = ctx.gen.generate(prompts, sampling_params(ctx.cfg))
    seconds = time.perf_counter() - t0
    lengths = out.response_mask.sum(dim=1).tolist()
    texts = [ctx.tokenizer.decode(out.response_ids[i, :n].tolist()) for i, n in enumerate(lengths)]
    rewards = torch.tensor([ctx.task.reward(examples[i // G], t) for i, t in enumerate(texts)],
                           dtype=torch.float32).view(len(examples), G)
    return prompts, out, rewards, seconds


def reuses_old_logprobs(cfg: RunConfig) -> bool:
    """One optimizer step per rollout batch: the training forward's log-probs are the old ones."""
    return cfg.optim.micro_steps == 1 and cfg.train.reuse_old_logprobs


def _importance_fn(cfg: RunConfig):
    """sub-batch (old_logprobs set) -> IS weights [b, T]: what the engine calls on the reuse path."""
    s = cfg.loss

    def weigh(b: TrainBatch) -> torch.Tensor:
        return importance_from_config(s, b.old_logprobs, b.gen_logprobs.to(b.old_logprobs.device), b.response_mask,
                                      advantages=b.advantages).weights

    return weigh


def replayed_logprobs(ctx: RunContext, prompts: list[list[int]], out: GenerationOutput, batch: TrainBatch
                      ) -> torch.Tensor:
    """engines.kernels matched: Float32[B, T] old log-probs from `ctx.replay_engine().score`, the
    generation engine's computation replayed in decode order on the trainer's weights, placed where
    batch.gen_logprobs sits (rollout.build_train_batch's layout); 0 off response_mask."""
    lp = ctx.replay_engine().score(prompts, out, ctx.cfg.rollout.temperature)
    return place_response_values(lp, batch.response_mask).to(batch.gen_logprobs.device)


def _train(ctx: RunContext, batch: TrainBatch, reuse: bool) -> dict[str, float]:
    """`micro_steps` optimizer steps; metrics averaged over them (token-weighted where it matters).

    reuse: the (single) step scores the batch itself; its old log-probs / IS weights are written back
    into `batch` in the batch's row order.
    With the mismatch guard on and several optimizer steps, each of them is guarded by the rollout step's
    mismatch (what the step logs), not by its minibatch's: the old log-probs are known up front there.
    """
    parts = split_rows(batch.input_ids.shape[0], ctx.cfg.optim.micro_steps, ctx.shuffle)
    guarded = {}
    if len(parts) > 1 and ctx.cfg.train.mismatch_guard.enabled:
        guarded["step_mismatch"] = global_mismatch(ctx.mesh, batch.old_logprobs, batch.gen_logprobs,
                                                   batch.response_mask)
    sums: dict[str, float] = {}
    for rows in parts:
        sub = batch.select(rows)
        if reuse:
            sub.old_logprobs = sub.is_weights = None
            result = ctx.train.train_step(sub, importance=_importance_fn(ctx.cfg))
            old, weights = result.old_logprobs, result.is_weights
            batch.old_logprobs = torch.empty_like(old).index_copy_(0, rows.to(old.device), old)
            batch.is_weights = torch.empty_like(batch.old_logprobs).index_copy_(
                0, rows.to(batch.old_logprobs.device), weights)
        else:
            result = ctx.train.train_step(sub, **guarded)
        metrics = result.metrics
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return {k: v / len(parts) for k, v in sums.items()}


def global_mismatch(mesh: Mesh, old: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor) -> float:
    """token_mult_prob_error over ALL ranks' data (old, gen, mask: this rank's [B, T]); world size 1: the
    pure function itself, else float64 sums and counts all-reduced (as _global_stats)."""
    if not mesh.distributed:
        return token_mult_prob_error(old, gen, mask)
    e_sum, n = mesh.all_reduce_sum(list(token_mult_prob_error_sum(old, gen, mask))).tolist()
    return e_sum / n if n else float("nan")


def _global_stats(mesh: Mesh, rewards: torch.Tensor, old: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor,
                  isw) -> dict[str, float]:
    """reward_mean, token_mult_prob_error, response_length_mean and the IS stats over ALL ranks' data.

    World size 1: the pure functions, exactly as a single process computes them. Otherwise float64
    sums and counts (token-weighted), all-reduced: equal to the single-process values on the same
    global batch up to float64 summation order.
    """
    m = mask.bool()
    n = int(m.sum())
    if not mesh.distributed:
        return {M_REWARD: float(rewards.mean()), M_MISMATCH: token_mult_prob_error(old, gen, m),
                "response_length_mean": n / m.shape[0], **importance_stats(isw)}
    e_local, _ = token_mult_prob_error_sum(old, gen, m)
    w, raw = isw.weights.double()[m], isw.raw.double()[m]
    s = mesh.all_reduce_sum([float(rewards.double().sum()), rewards.numel(), n, m.shape[0],
                             e_local, float(w.sum()), float(raw.sum()),
                             float((isw.truncated & m).sum()), float((isw.masked & m).sum())]).tolist()
    mx = mesh.all_reduce_max([float(w.max()) if n else 0.0, float(raw.max()) if n else 0.0]).tolist()
    r_sum, r_n, n_all, rows, e_sum, w_sum, raw_sum, trunc, masked = s
    per_token = (lambda x: x / n_all) if n_all else (lambda x: 0.0)  # noqa: E731
    return {M_REWARD: r_sum / r_n, M_MISMATCH: e_sum / n_all if n_all else float("nan"),
            "response_length_mean": n_all / rows, M_IS_WEIGHT: per_token(w_sum), "is_weight_max": mx[0],
            "is_raw_weight_mean": per_token(raw_sum), "is_raw_weight_max": mx[1],
            "is_fraction_truncated": per_token(trunc), "is_fraction_masked": per_token(masked)}


def kv_scale_metrics(ctx: RunContext) -> dict[str, float]:
    """M_KV_SCALE_STEP and M_KV_SCALE_CHECKSUM of the KV scales the last rollout used (fp8.kv_cache e4m3
    only; {} otherwise): the training step whose weights they were computed with, and a checksum of them."""
    if ctx.recipe.kv_cache != "e4m3":
        return {}
    step, total = ctx.gen.kv_scales_in_use()
    return {M_KV_SCALE_STEP: step, M_KV_SCALE_CHECKSUM: total}


def held_kv_scales(ctx: RunContext) -> KVScales | None:
    """The per-layer KV scales the generation engine holds for its weights (fp8.kv_cache e4m3 with kv_scale
    trainer or first_forward: the native engine only, config-checked), else None."""
    if ctx.recipe.kv_cache != "e4m3" or ctx.recipe.kv_scale == "per_token_head":
        return None
    return ctx.gen.held_kv_scales()


def grpo_step(ctx: RunContext) -> StepResult:
    """Run one step; returns its metrics (names per the MLflow contract in docs/design.md, global over ranks)
    and this rank's batch (StepResult)."""
    t_start = time.perf_counter()
    loss_cfg = ctx.cfg.loss
    prompts, out, rewards, gen_s = _rollout(ctx)
    kv_metrics = kv_scale_metrics(ctx)  # the scales this rollout used, before the refit replaces them
    kv_scales = held_kv_scales(ctx)
    batch = build_train_batch(prompts, out, ctx.tokenizer.pad_id)
    adv = grpo.group_advantages(rewards).reshape(-1)
    batch.advantages = broadcast_advantages(adv, batch.response_mask)
    mask = batch.response_mask
    matched = ctx.cfg.engines.kernels == "matched"
    reuse = reuses_old_logprobs(ctx.cfg) and ctx.train.reports_old_logprobs and not matched
    if matched:  # the old log-probs replay the generation engine's computation (the zero-mismatch floor)
        batch.old_logprobs = replayed_logprobs(ctx, prompts, out, batch)
        batch.is_weights = _importance_fn(ctx.cfg)(batch)
    elif not reuse:
        batch.old_logprobs = ctx.train.logprobs(batch)
        batch.is_weights = _importance_fn(ctx.cfg)(batch)
    if ctx.ref is not None:
        batch.ref_logprobs = ctx.ref.logprobs(batch)
    t_train = time.perf_counter()
    train_metrics = _train(ctx, batch, reuse)
    ctx.weights_step += 1
    ctx.refit_generation(batch)  # under fp8.kv_scale trainer the KV scales come from this batch, new weights
    train_s = time.perf_counter() - t_train
    isw = importance_from_config(loss_cfg, batch.old_logprobs, batch.gen_logprobs, mask, advantages=batch.advantages)
    stats = _global_stats(ctx.mesh, rewards, batch.old_logprobs, batch.gen_logprobs, mask, isw)
    n_resp = int(ctx.mesh.all_reduce_sum([int(mask.sum())])[0])
    metrics = {
        M_REWARD: stats.pop(M_REWARD),
        M_MISMATCH: stats.pop(M_MISMATCH),
        "response_length_mean": stats.pop("response_length_mean"),
        "generation_tokens_per_s": n_resp / max(float(ctx.mesh.all_reduce_max([gen_s])[0]), 1e-9),
        "train_time_s": train_s,
        **stats,
        **train_metrics,
        **observe_step(batch, ctx.mesh),  # the mismatch-metric catalogue (fp8rl_core/diagnostics)
        **executor_flags(),  # a CUDA GEMM fell back to BF16 output: say so in the run, not only in a warning
        **kv_metrics,
    }
    metrics[M_STEP_TIME] = time.perf_counter() - t_start
    metrics[M_TOKENS_PER_S] = n_resp / metrics[M_STEP_TIME]  # response tokens generated + trained per second
    return StepResult(metrics, batch, kv_scales)
