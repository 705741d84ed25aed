"""Cost of the mismatch diagnostics vs one GRPO step, measured in one run (goal: catalogue < 2% of a step).

Usage: PYTHONPATH=. python benchmarks/diagnostics.py [--prompts 16] [--group 8] [--max-new-tokens 8]
           [--steps 6] [--warmup 1] [--repeats 50] [--threads 1] [--recipe fp8_gen] [--cache-dir DIR]
           [--synthetic 512x1024] [--set key=value ...]

1) A real run context of the study's default shape (P prompts x G samples, the tiny preset, the cached
   warm start of the default config; `--warmstart-steps` to make a cheap one) runs `--steps` GRPO
   steps; each step's batch (kept by the diagnostics hook) is then scored `--repeats` times by the
   catalogue (`step_diagnostics`) and once by the worst-token table. Reported: median step time, median
   catalogue time, their ratio; the worst-token table's time and ratio.
   Note the step time already contains one catalogue pass (grpo_step calls the hook).
2) The catalogue alone on a synthetic [B, T] batch (`--synthetic`), to see its per-token cost at the
   scale of a real cluster step (no step to compare with here: ns per valid token).
The machine's cores may be shared: the load average is printed before and after; only ratios measured
in the same run mean anything (docs/design.md).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fp8rl_core.config import load_run_config
from fp8rl_core.diagnostics.catalogue import step_diagnostics
from fp8rl_core.diagnostics.tokens import worst_tokens
from fp8rl_core.loop.builder import build_context
from fp8rl_core.loop.step import grpo_step


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_step(args: argparse.Namespace) -> None:
    overrides = [f"recipe={args.recipe}", f"threads={args.threads}", "device=cpu",
                 f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.group}",
                 f"rollout.max_new_tokens={args.max_new_tokens}", f"warmstart.cache_dir={args.cache_dir}"]
    if args.warmstart_steps is not None:
        overrides.append(f"warmstart.steps={args.warmstart_steps}")
    cfg = load_run_config(None, overrides + list(args.set))
    ctx = build_context(cfg, progress=False)
    step_s, cat_s, tab_s, tokens = [], [], [], []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        b = grpo_step(ctx).batch
        dt = time.perf_counter() - t0
        if i < args.warmup:
            continue
        step_s.append(dt)
        tokens.append(int(b.response_mask.sum()))
        cat_s.append(_median_time(lambda b=b: step_diagnostics(b.old_logprobs, b.gen_logprobs, b.response_mask,
                                                               b.is_weights), args.repeats))
        tab_s.append(_median_time(lambda b=b: worst_tokens(b.input_ids, b.attention_mask, b.response_mask,
                                                           b.old_logprobs, b.gen_logprobs, b.is_weights,
                                                           ctx.tokenizer, 8, 12, 1), 5))
    step, cat, tab = statistics.median(step_s), statistics.median(cat_s), statistics.median(tab_s)
    shape = tuple(b.input_ids.shape)
    print(f"step: recipe {args.recipe}, P={args.prompts} G={args.group} max_new_tokens={args.max_new_tokens}, "
          f"batch {shape}, {statistics.median(tokens)} valid tokens (median), threads {args.threads}")
    print(f"  grpo_step      {step * 1e3:9.2f} ms (median of {len(step_s)})")
    print(f"  catalogue      {cat * 1e3:9.3f} ms  = {100 * cat / step:.3f}% of a step (goal < 2%)")
    print(f"  worst tokens   {tab * 1e3:9.3f} ms  = {100 * tab / step:.3f}% of a step "
          "(every diagnostics.worst_tokens_every steps)")


def bench_synthetic(spec: str, repeats: int) -> None:
    B, T = (int(x) for x in spec.lower().split("x"))
    g = torch.Generator().manual_seed(0)
    gen = -torch.rand(B, T, generator=g) * 5
    train = gen + 0.05 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    w = torch.exp(train - gen).clamp(max=2.0)
    t = _median_time(lambda: step_diagnostics(train, gen, mask, w), max(3, repeats // 10))
    n = int(mask.sum())
    print(f"synthetic [{B}, {T}], {n} valid tokens: catalogue {t * 1e3:.1f} ms = {t / n * 1e9:.1f} ns per valid token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--recipe", default="fp8_gen")
    ap.add_argument("--warmstart-steps", type=int, default=None)
    ap.add_argument("--cache-dir", default=".fp8rl/warmstart")
    ap.add_argument("--set", nargs="*", default=[], help="more run-config overrides (key=value)")
    ap.add_argument("--synthetic", default="512x1024", help="BxT of the synthetic batch ('' to skip)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    bench_step(args)
    if args.synthetic:
        bench_synthetic(args.synthetic, args.repeats)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
