"""One GRPO step as the study runs it: generate -> score -> (mismatch, IS weights) -> train -> refit.

    1) sample P prompts, G generations each, from the generation engine (its own weight copy);
    2) rewards [P, G] -> leave-one-out advantages;
    3) the training engine scores the sampled tokens under the same weights that generated them
       (old log-probs): token_mult_prob_error(old, gen) is the engines' mismatch;
    4) importance weights w = f(old - gen) correct the policy gradient for that mismatch;
    5) `optim.micro_steps` optimizer steps on shuffled minibatches of the rollout batch;
    6) refit the generation engine from the updated trainer weights.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from fp8rl_core import grpo
from fp8rl_core.config import RunConfig
from fp8rl_core.engines.base import GenerationEngine, SamplingParams, TrainingEngine
from fp8rl_core.importance import importance_weights_with_stats
from fp8rl_core.metrics import token_mult_prob_error
from fp8rl_core.rollout import broadcast_advantages, build_train_batch, split_rows


@dataclass
class RunContext:
    cfg: RunConfig
    tokenizer: Any
    task: Any
    gen: GenerationEngine
    train: TrainingEngine
    ref: TrainingEngine | None  # frozen reference policy for the KL term (kl_coef > 0)
    data_rng: random.Random  # prompt sampling; its state is checkpointed
    shuffle: torch.Generator  # minibatch order; its state is checkpointed


def sampling_params(cfg: RunConfig) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def _rollout(ctx: RunContext) -> tuple[list[list[int]], Any, torch.Tensor, float]:
    """Generate P x G responses. Returns (prompts [B], output, rewards [P, G], seconds)."""
    P, G = ctx.cfg.rollout.prompts_per_step, ctx.cfg.rollout.samples_per_prompt
    examples = ctx.task.sample_train(ctx.data_rng, P)
    prompts = [ctx.tokenizer.encode(ex.prompt) for ex in examples for _ in range(G)]
    t0 = time.perf_counter()
    out = ctx.gen.generate(prompts, sampling_params(ctx.cfg))
    seconds = time.perf_counter() - t0
    lengths = out.response_mask.sum(dim=1).tolist()
    texts = [ctx.tokenizer.decode(out.response_ids[i, :n].tolist()) for i, n in enumerate(lengths)]
    rewards = torch.tensor([ctx.task.reward(examples[i // G], t) for i, t in enumerate(texts)],
                           dtype=torch.float32).view(P, G)
    return prompts, out, rewards, seconds


def _train(ctx: RunContext, batch) -> dict[str, float]:
    """`micro_steps` optimizer steps; metrics averaged over them (token-weighted where it matters)."""
    parts = split_rows(batch.input_ids.shape[0], ctx.cfg.optim.micro_steps, ctx.shuffle)
    sums: dict[str, float] = {}
    for rows in parts:
        for k, v in ctx.train.train_step(batch.select(rows)).items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return {k: v / len(parts) for k, v in sums.items()}


def grpo_step(ctx: RunContext) -> dict[str, float]:
    """Run one step; returns its metrics (names per the MLflow contract in DESIGN.md)."""
    t_start = time.perf_counter()
    loss_cfg = ctx.cfg.loss
    prompts, out, rewards, gen_s = _rollout(ctx)
    batch = build_train_batch(prompts, out, ctx.tokenizer.pad_id)
    adv = grpo.group_advantages(rewards).reshape(-1)
    batch.advantages = broadcast_advantages(adv, batch.response_mask)
    batch.old_logprobs = ctx.train.logprobs(batch)
    mask = batch.response_mask
    batch.is_weights, is_stats = importance_weights_with_stats(
        batch.old_logprobs, batch.gen_logprobs, mask, loss_cfg.importance_sampling,
        cap=loss_cfg.is_cap, low=loss_cfg.is_low, high=loss_cfg.is_high)
    if ctx.ref is not None:
        batch.ref_logprobs = ctx.ref.logprobs(batch)
    t_train = time.perf_counter()
    train_metrics = _train(ctx, batch)
    ctx.gen.refit(ctx.train.weights())
    train_s = time.perf_counter() - t_train
    n_resp = int(mask.sum())
    metrics = {
        "reward_mean": float(rewards.mean()),
        "token_mult_prob_error": token_mult_prob_error(batch.old_logprobs, batch.gen_logprobs, mask),
        "response_length_mean": n_resp / mask.shape[0],
        "generation_tokens_per_s": n_resp / max(gen_s, 1e-9),
        "train_time_s": train_s,
        **is_stats,
        **train_metrics,
    }
    metrics["step_time_s"] = time.perf_counter() - t_start
    metrics["tokens_per_s"] = n_resp / metrics["step_time_s"]  # response tokens generated + trained per second
    return metrics
