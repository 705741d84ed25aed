"""Phase 4: GRPO steps per recipe on a random-init ~1B Llama, with time per phase and memory against the plan.

First a random-init checkpoint of models.policy (BF16 on disk: no warm start; a random policy samples
to max_new_tokens, which is what makes the step's cost), then per recipe in --recipes (bf16, fp8_gen,
fp8_e2e): fp8rl_core's own run path (load_run_config -> build_context -> grpo_step, native engines, in
this process), --warmup unmeasured steps, then --steps measured ones. Columns: time = median step;
`x baseline` = step / bf16's step; tmpe = token_mult_prob_error (mean over the measured steps); peak GiB
= torch.cuda.max_memory_allocated from before the engines are built to the last step (with --cpu: the
process's peak RSS, which includes the earlier phases); plan GiB = memory_plan.plan_for_run's peak for
this config at one rank, the longest prompt of the task and this device. The note splits the step into
generate / score (old log-probs, rewards) / train (optimizer step + refit of the generation engine).
Rollout: --prompts x --samples sequences of at most --new-tokens tokens (GPU 16 x 8 x 32; --cpu 2 x 2 x 4).
"""
from __future__ import annotations

import gc
import random
import resource
import statistics
import time

from gpu_phases import models
from gpu_phases.common import GiB, Run, row

PHASE = "grpo"


def run(run: Run) -> None:
    run.case(PHASE, "random-init policy", lambda: checkpoint(run))
    if "policy" not in run.shared:
        run.report.add([row(PHASE, "GRPO steps", "skipped", note="no policy checkpoint (the row above)")])
        return
    base: dict[str, float] = {}
    for recipe in run.args.recipes:
        run.case(PHASE, f"GRPO step [{recipe}]", lambda r=recipe: step_rows(run, r, base))


def checkpoint(run: Run) -> list[dict]:
    cfg = models.policy(run.cpu)
    path, n, seconds = models.random_checkpoint(cfg, run.work / "policy", run.device)
    run.shared["policy"] = path
    return [row(PHASE, "random-init policy", time_ms=seconds * 1e3,
                note=f"{n / 1e9:.3f} B parameters: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
                     f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV, SwiGLU "
                     f"{cfg.intermediate_size}, vocab {cfg.vocab_size}; written BF16",
                data={"parameters": n, "path": str(path)})]


def run_config(run: Run, recipe: str):
    from fp8rl_core.config import run_config_from_dict

    a = run.args
    return run_config_from_dict({
        "recipe": recipe, "device": run.device.type, "threads": a.threads, "seed": 0,
        "output_dir": str(run.work / "runs" / recipe), "model": {"path": str(run.shared["policy"])},
        "rollout": {"prompts_per_step": a.prompts, "samples_per_prompt": a.samples, "max_new_tokens": a.new_tokens},
        "task": {"val_size": 4}})


def longest_prompt(ctx) -> int:
    """Tokens of the task's longest training prompt (over 512 draws): the memory plan's prompt length."""
    rng = random.Random(0)
    return max(len(ctx.tokenizer.encode(ex.prompt)) for ex in ctx.task.sample_train(rng, 512))


def step_rows(run: Run, recipe: str, base: dict[str, float]) -> list[dict]:
    import torch

    from fp8rl_core.distributed.memory_plan import plan_for_run
    from fp8rl_core.loop.builder import build_context
    from fp8rl_core.loop.step import grpo_step

    cuda = run.device.type == "cuda"
    cfg = run_config(run, recipe)
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(run.device)
    t0 = time.perf_counter()
    ctx = build_context(cfg, progress=False)
    built = time.perf_counter() - t0
    try:
        for _ in range(run.args.warmup):
            grpo_step(ctx)
        steps = [measured_step(ctx, grpo_step) for _ in range(run.args.steps)]
        prompt_tokens = longest_prompt(ctx)
        if cuda:  # before the engines go: device memory in use (allocator cache, CUDA and NCCL contexts)
            peak, reserved = torch.cuda.max_memory_allocated(run.device), torch.cuda.max_memory_reserved(run.device)
            free, total = torch.cuda.mem_get_info(run.device)
        else:
            peak = reserved = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            free = total = 0
    finally:
        del ctx
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    plan = plan_for_run(cfg, 1, prompt_tokens=prompt_tokens, device=run.device.type)
    med = {k: statistics.median(s[k] for s in steps) for k in ("step", "gen", "score", "train")}
    if recipe == "bf16":
        base["step"] = med["step"]
    tmpe = statistics.mean(s["tmpe"] for s in steps)
    rows_n = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    vs_plan = (f"peak allocated / plan {peak / plan.peak:.2f} (reserved {reserved / GiB:.1f} GiB, in use on the "
               f"device {(total - free) / GiB:.1f} GiB)" if cuda else
               "peak = the process's peak RSS (torch and every phase so far): not comparable to the plan")
    return [row(PHASE, f"GRPO step [{recipe}]", time_ms=med["step"] * 1e3,
                ratio=med["step"] / base["step"] if base.get("step") else None, tmpe=tmpe,
                peak_gib=peak / GiB, plan_gib=plan.peak / GiB,
                note=f"gen {med['gen']:.2f} s / score {med['score']:.2f} s / train+refit {med['train']:.2f} s; "
                     f"{rows_n} sequences, {statistics.mean(s['tokens'] for s in steps):.0f} response tokens; built "
                     f"in {built:.1f} s; {vs_plan} (plan: {plan.phase} phase)",
                data={"steps": steps, "build_s": built, "peak_allocated": peak, "peak_reserved": reserved,
                      "device_used_at_end": total - free, "plan_peak": plan.peak, "plan_phase": plan.phase,
                      "plan_parts": plan.device, "prompt_tokens": prompt_tokens})]


def measured_step(ctx, grpo_step) -> dict[str, float]:
    t0 = time.perf_counter()
    m = grpo_step(ctx).metrics
    wall = time.perf_counter() - t0
    tokens = m["response_length_mean"] * ctx.cfg.rollout.prompts_per_step * ctx.cfg.rollout.samples_per_prompt
    gen = tokens / m["generation_tokens_per_s"]
    return {"step": wall, "gen": gen, "train": m["train_time_s"], "score": wall - gen - m["train_time_s"],
            "tmpe": m["token_mult_prob_error"], "tokens": tokens}
