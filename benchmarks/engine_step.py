"""Per recipe: time and peak memory of one generate + train step (`grpo_step`) of the default run config.

Usage: PYTHONPATH=. python benchmarks/engine_step.py [--recipes bf16 fp8_gen fp8_e2e] [--steps 8] [--warmup 2]
           [--threads 2] [--cache-dir .fp8rl/warmstart] [--set key=value ...]

The default run config (fp8rl_core/config/run_config.py: the `tiny` preset, 16 prompts x 8 samples, at most 8 new
tokens, its warm-start checkpoint) plus `--set` dotted overrides. The warm start is trained (or found in
the cache) by this process first; then every recipe runs in a fresh subprocess, so that its peak RSS
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`) is its own: imports + engines built + `--warmup` + `--steps`
steps. Columns (median over the measured steps): step = wall time of `grpo_step(ctx)`; gen = the
generation engine's `generate`; train = optimizer step(s) + refit of the generation engine; score = the
rest (training engine's old-log-prob pass, rewards, IS weights); RSS built = peak RSS once both engines
exist, before any step; tmpe = token_mult_prob_error, mean over the measured steps. The baseline is the
bf16 recipe measured in the same run (`x bf16`: step time / bf16's). The machine's 2 cores are shared:
the load average is printed before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


def overrides(args: argparse.Namespace, recipe: str) -> list[str]:
    return [f"recipe={recipe}", f"threads={args.threads}", "device=cpu", f"warmstart.cache_dir={args.cache_dir}",
            *args.set]


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def worker(args: argparse.Namespace, recipe: str) -> dict:
    """Runs in the subprocess: build, warm up, measure; returns the per-step numbers."""
    from fp8rl_core.config import load_run_config
    from fp8rl_core.loop.builder import build_context
    from fp8rl_core.loop.step import grpo_step

    cfg = load_run_config(None, overrides(args, recipe))
    ctx = build_context(cfg, progress=False)
    rss_built = peak_rss_mib()
    for _ in range(args.warmup):
        grpo_step(ctx)
    B = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        m = grpo_step(ctx).metrics
        wall = time.perf_counter() - t0
        gen = m["response_length_mean"] * B / m["generation_tokens_per_s"]
        steps.append({"step": wall, "gen": gen, "train": m["train_time_s"],
                      "score": wall - gen - m["train_time_s"], "tmpe": m["token_mult_prob_error"],
                      "tokens": m["response_length_mean"] * B})
    import torch

    return {"recipe": recipe, "threads": torch.get_num_threads(), "rss_built": rss_built,
            "rss_peak": peak_rss_mib(), "steps": steps, "batch": B}


def run_recipe(args: argparse.Namespace, recipe: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", recipe, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--threads", str(args.threads), "--cache-dir", args.cache_dir]
    for item in args.set:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": _pythonpath()})
    if proc.returncode != 0:
        raise RuntimeError(f"recipe {recipe}: worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parents[1])
    rest = os.environ.get("PYTHONPATH", "")
    return f"{root}{os.pathsep}{rest}" if rest else root


def warm_start(args: argparse.Namespace) -> Path:
    """Train (or find) the warm-start checkpoint once, here, so that no worker's peak RSS includes it."""
    import torch

    from fp8rl_core.config import load_run_config
    from fp8rl_core.loop.builder import initial_checkpoint, resolve_setup

    torch.set_num_threads(args.threads)
    cfg = load_run_config(None, overrides(args, "bf16"))
    return initial_checkpoint(resolve_setup(cfg, "cpu"), progress=True)


def print_table(results: list[dict]) -> None:
    med = {r["recipe"]: {k: statistics.median(s[k] for s in r["steps"]) for k in ("step", "gen", "train", "score")}
           for r in results}
    base = med.get("bf16", {}).get("step")
    print(f"{'recipe':<8} {'step s':>7} {'gen s':>7} {'train s':>8} {'score s':>8} {'tokens/s':>9} "
          f"{'RSS built MiB':>14} {'peak RSS MiB':>13} {'tmpe':>9} {'x bf16':>7}")
    for r in results:
        m = med[r["recipe"]]
        tok_s = sum(s["tokens"] for s in r["steps"]) / sum(s["step"] for s in r["steps"])
        tmpe = statistics.mean(s["tmpe"] for s in r["steps"])
        ratio = f"{m['step'] / base:>6.2f}x" if base else f"{'-':>7}"
        print(f"{r['recipe']:<8} {m['step']:>7.3f} {m['gen']:>7.3f} {m['train']:>8.3f} {m['score']:>8.3f} "
              f"{tok_s:>9.0f} {r['rss_built']:>14.0f} {r['rss_peak']:>13.0f} {tmpe:>9.6f} {ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", default=["bf16", "fp8_gen", "fp8_e2e"])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per recipe")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (run config `threads`)")
    ap.add_argument("--cache-dir", default=".fp8rl/warmstart", help="warm-start cache (shared with fp8rl-train)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run-config override")
    ap.add_argument("--worker", metavar="RECIPE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args, args.worker)))
        return
    load0 = os.getloadavg()
    ckpt = warm_start(args)
    results = [run_recipe(args, recipe) for recipe in args.recipes]
    r0 = results[0]
    print(f"default run config{' + ' + ' '.join(args.set) if args.set else ''}: {r0['batch']} sequences per step, "
          f"{args.steps} measured steps after {args.warmup} warm-up, torch threads {r0['threads']}, model {ckpt}")
    print_table(results)
    print(f"load average (1, 5, 15 min): before {tuple(round(x, 2) for x in load0)}, "
          f"after {tuple(round(x, 2) for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
