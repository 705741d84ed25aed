"""One GRPO step (generation + training): our core's `grpo_step` vs TRL's `GRPOTrainer`, in one run.

Usage: PYTHONPATH=. python benchmarks/grpo_step.py [--prompts 16] [--group 8] [--max-new-tokens 8]
           [--steps 8] [--warmup 2] [--threads 2] [--recipes bf16 fp8_gen fp8_e2e fp32 bf16-emulated] [--before]
           [--trl-bf16 | --no-trl-bf16] [--no-trl] [--clock wall|cpu] [--warmstart-steps N] [--dtype bf16|fp32]
           [--cache-dir .fp8rl/warmstart]
Needs TRL, a benchmark-only dependency: pip install trl torch==2.13.0   (pyproject extra `bench`); not with --no-trl

Same on both sides, so that only the implementation differs:
- model: the warm-start checkpoint of the default run config (the `tiny` preset: Llama, 4 layers, hidden
  256, vocab 32), loaded as a `transformers.LlamaForCausalLM` (FP32 master weights) for TRL;
- tokenizer: our character tokenizer saved as an HF tokenizer, with a BOS post-processor so that TRL's
  prompt ids equal ours token for token;
- data: the same arithmetic prompts in the same order (drawn from a copy of our run's data RNG; TRL's
  dataset is not shuffled), P prompts x G samples per step, at most `--max-new-tokens` new tokens, the run config's
  rollout temperature (2.0 by default);
- reward: the task's exact match; one optimizer step per rollout batch (TRL: num_iterations=1,
  steps_per_generation=1), no KL (beta=0), ratio clip 0.2, AdamW at our lr, grad clip 1.0;
- threads: torch.set_num_threads(--threads) for both, in this one process.
TRL runs on the CPU without vLLM, gradient checkpointing off (TRL's default is on; off only drops the
recomputation) and BF16 autocast in generation and training, as our bf16 recipe (`--no-trl-bf16`: FP32).
Columns: s/step = median seconds of a steady-state step (the first `--warmup` steps of each side skipped;
our variants take their steps in turns, one step each per round);
TRL is timed from `on_step_begin` to `on_step_end` (generation, reward, log-probs, backward, optimizer
step), ours around `grpo_step(ctx)` (the same work plus the training engine's old-log-prob pass and the
refit of the generation engine); gen s = the generation call (TRL's `_generate_single_turn`, ours
`generate`, both timed by this script); rest s = s/step - gen s; tokens = response tokens per step (up to and including
EOS);
tokens/s = their sum / the sum of step times; reward = mean exact-match reward (a check that both sides
solve the same task with the same model); TRL/ours = TRL s/step / ours.
Rows of ours: one per `--recipes` entry; `fp32` is the bf16 recipe with both engines in plain FP32
(model.dtype=fp32: no autocast, no quantization), the floor of the CPU's exact FP8 emulation (its GEMMs
are FP32). `--dtype fp32` runs every recipe with model.dtype=fp32, the study's setting on a CPU without
BF16 hardware (AVX2 only: torch's BF16 matmuls there are 10-30x slower than FP32): the bf16 recipe is then
the fp32 floor, and `--no-trl-bf16` gives TRL the same precision. `<recipe>-emulated` / `<recipe>-native`
(e.g. `bf16-emulated`): the recipe in BF16 with model.bf16_compute=emulated / native, whatever --dtype says;
a plain recipe takes `auto` (native on CPUs with AVX512_BF16 / AMX, emulated elsewhere: the header says
which). `<recipe>@key=value[,key=value]` (e.g. `fp8_e2e@format=mxfp8`): the recipe with those `fp8.*` knobs
(issue 23's formats and knobs). Column `x first`: s/step over the first row of ours, measured in the same
run (the step cost of a knob against the default recipe). Issue goal: the emulated BF16 step within 1.15x
of the fp32 step (its GEMMs are the same FP32 GEMMs plus BF16 roundings), printed with the CPU flags that
decide `auto`. Every row of ours starts from
the same checkpoint (the warm start of the first recipe's config, model.path), so that all do the same
work from the same policy; the fp32 row used to train its own FP32 warm start. `--before` adds `fp8_gen` / `fp8_e2e`
rows with the pure-torch quantizer and no weight cache (FP8RL_FUSED=0 FP8RL_WEIGHT_CACHE=0: the code paths
before issue 16), measured in the same run.
The goals of issue 16 are printed under the table, each with its floor and ratio.
The machine's 2 cores are shared with other jobs: the load average is printed before and after. Under
such load, 2 OpenMP threads per process can run several times slower than 1 (threads spin at barriers
while the other core is taken): compare `--threads 1` when the numbers look odd.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.config import RunConfig, load_run_config
from fp8rl_core.io.environ import environ
from fp8rl_core.loop.builder import build_context, initial_checkpoint, load_tokenizer
from fp8rl_core.loop.step import grpo_step
from fp8rl_core.model.bf16 import recorded_flags, resolve_bf16_compute
from fp8rl_core.tasks import Example, make_task

CLOCK = time.perf_counter  # --clock cpu: time.process_time (the compute time with --threads 1)
BEFORE_ENV = {"FP8RL_FUSED": "0", "FP8RL_WEIGHT_CACHE": "0"}  # the quantization code paths before issue 16


BF16_PATHS = ("emulated", "native")  # `<recipe>-<path>`: the recipe in BF16 with model.bf16_compute=<path>


def run_config(args: argparse.Namespace, recipe: str) -> RunConfig:
    """`fp32`: the bf16 recipe with model.dtype=fp32 (both engines FP32); `<recipe>-emulated` /
    `<recipe>-native`: the recipe in BF16 with model.bf16_compute emulated / native; `<recipe> before`:
    the recipe. With args.model_path set every variant starts from that checkpoint."""
    recipe = recipe.removesuffix(" before")
    recipe, _, knobs = recipe.partition("@")
    fp8 = [f"fp8.{kv}" for kv in knobs.split(",") if kv]
    base, _, path = recipe.rpartition("-")
    if recipe == "fp32":
        dtype = ["recipe=bf16", "model.dtype=fp32"]
    elif path in BF16_PATHS:
        dtype = [f"recipe={base}", "model.dtype=bf16", f"model.bf16_compute={path}"]
    else:
        dtype = [f"recipe={recipe}", f"model.dtype={args.dtype}"]
    overrides = [*dtype, *fp8, f"threads={args.threads}", "device=cpu",
                 f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.group}",
                 f"rollout.max_new_tokens={args.max_new_tokens}", f"warmstart.cache_dir={args.cache_dir}"]
    if args.warmstart_steps is not None:
        overrides.append(f"warmstart.steps={args.warmstart_steps}")
    if getattr(args, "model_path", None):
        overrides.append(f"model.path={args.model_path}")
    return load_run_config(None, overrides)




def time_ours(args: argparse.Namespace, names: list[str]) -> dict[str, dict[str, Any]]:
    """Per variant: seconds, response tokens, generation seconds and reward of `args.steps` grpo_step
    calls after `args.warmup` unmeasured ones, and a copy of the run's data RNG as it was before the
    first step (so that TRL can see the same prompts). The variants take their steps in turns (one step
    of each per round), so that a change of the machine's load reaches all of them alike."""
    ctxs, out = {}, {}
    for name in names:
        with environ(BEFORE_ENV if name.endswith(" before") else {}):
            ctxs[name] = build_context(run_config(args, name), progress=False)
        rng = random.Random()
        rng.setstate(ctxs[name].data_rng.getstate())
        out[name] = {"times": [], "tokens": [], "gen": [], "reward": [], "rng": rng}
    gen_seconds = {name: timed_generate(ctx) for name, ctx in ctxs.items()}
    for step in range(args.warmup + args.steps):
        for name, ctx in ctxs.items():
            gen_seconds[name].clear()
            with environ(BEFORE_ENV if name.endswith(" before") else {}):
                t0 = CLOCK()
                m = grpo_step(ctx)
                seconds = CLOCK() - t0
            if step < args.warmup:
                continue
            r, n = out[name], m["response_length_mean"] * args.prompts * args.group
            r["times"].append(seconds)
            r["tokens"].append(n)
            r["gen"].append(sum(gen_seconds[name]))
            r["reward"].append(m["reward_mean"])
    return out


def timed_generate(ctx: Any) -> list[float]:
    """Wrap ctx.gen.generate so that each call appends its CLOCK seconds to the returned list."""
    seconds: list[float] = []
    generate = ctx.gen.generate

    def timed(*a: Any, **kw: Any) -> Any:
        t0 = CLOCK()
        result = generate(*a, **kw)
        seconds.append(CLOCK() - t0)
        return result

    ctx.gen.generate = timed
    return seconds


def save_hf_tokenizer(folder: Path) -> Any:
    """Our char tokenizer as an HF tokenizer that prepends BOS like `Tokenizer.encode` does."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from fp8rl_core.model.tokenizer import char_tokenizer

    tok = char_tokenizer()
    tok.tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_id)])
    tok.save(folder)
    return AutoTokenizer.from_pretrained(str(folder), padding_side="left")


class _StepTimer:
    """A transformers TrainerCallback recording wall-clock time from on_step_begin to on_step_end."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                timer.t0 = CLOCK()

            def on_step_end(self, args, state, control, **kw):
                timer.times.append(CLOCK() - timer.t0)

        self.times: list[float] = []
        self.tokens: list[int] = []  # response tokens per step, counted by the reward function
        self.reward: list[float] = []  # mean reward per step
        self.gen: list[float] = []  # seconds in TRL's generation call per step
        self.t0 = 0.0
        self.callback = Callback()


def trl_trainer(cfg: RunConfig, ckpt: Path, prompts: list[Example], args: argparse.Namespace,
                timer: _StepTimer, out: Path) -> Any:
    import transformers
    from datasets import Dataset
    from transformers import LlamaForCausalLM, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    task = make_task(cfg.task)
    tokenizer = save_hf_tokenizer(out / "tokenizer")
    model = LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)

    def exact_match(completions: list[str], answer: list[str], completion_ids: list[list[int]], **_: Any):
        timer.tokens.append(sum(len(c) for c in completion_ids))
        rewards = [task.reward(Example("", a), c) for c, a in zip(completions, answer)]
        timer.reward.append(sum(rewards) / len(rewards))
        return rewards

    P, G, o = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.optim
    targs = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=args.trl_bf16, use_vllm=False, seed=cfg.seed,
        per_device_train_batch_size=P * G, gradient_accumulation_steps=1, num_generations=G,
        num_iterations=1, max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, beta=0.0, epsilon=cfg.loss.clip_low, epsilon_high=cfg.loss.clip_high,
        learning_rate=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
        adam_epsilon=o.eps, max_grad_norm=o.grad_clip, lr_scheduler_type="constant", warmup_steps=0,
        max_steps=args.warmup + args.steps, gradient_checkpointing=False, shuffle_dataset=False,
        report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0)
    data = Dataset.from_list([{"prompt": ex.prompt, "answer": ex.answer} for ex in prompts])
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=targs, train_dataset=data,
                          processing_class=tokenizer, callbacks=[timer.callback])
    trainer.remove_callback(PrinterCallback)  # it prints TRL's metrics dict into our table
    generate = trainer._generate_single_turn  # private, wrapped for a generation/training split only

    def timed_generate(*a: Any, **kw: Any) -> Any:
        t0 = CLOCK()
        result = generate(*a, **kw)
        timer.gen.append(CLOCK() - t0)
        return result

    trainer._generate_single_turn = timed_generate
    return trainer


def time_trl(cfg: RunConfig, ckpt: Path, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds, response tokens and generation seconds of TRL's steady-state steps; prompts drawn with rng."""
    task = make_task(cfg.task)
    prompts = [ex for _ in range(args.warmup + args.steps) for ex in task.sample_train(rng, args.prompts)]
    timer = _StepTimer()
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        trl_trainer(cfg, ckpt, prompts, args, timer, Path(tmp)).train()
    w = args.warmup
    if len(timer.times) != w + args.steps or len(timer.tokens) != w + args.steps:
        raise RuntimeError(f"TRL ran {len(timer.times)} steps and {len(timer.tokens)} reward calls; "
                           f"expected {w + args.steps} of each")
    gen = timer.gen[w:] if len(timer.gen) == len(timer.times) else [float("nan")] * args.steps
    return {"times": timer.times[w:], "tokens": timer.tokens[w:], "gen": gen, "reward": timer.reward[w:]}


def row(name: str, r: dict[str, Any], baseline: float | None, first: float | None = None) -> str:
    s = statistics.median(r["times"])
    tok_s = sum(r["tokens"]) / sum(r["times"])
    tokens = statistics.mean(r["tokens"])
    gen = statistics.median(r["gen"])
    rest = statistics.median([t - g for t, g in zip(r["times"], r["gen"])])
    ratio = f"{baseline / s:>7.2f}x" if baseline else f"{'-':>8}"
    reward = statistics.mean(r["reward"])
    rel = f"{s / first:>8.2f}" if first else f"{'-':>8}"
    return (f"{name:<36} {s:>9.3f} {gen:>8.3f} {rest:>9.3f} {tokens:>7.0f} {tok_s:>9.0f} {reward:>7.3f} {ratio}"
            f" {rel}")


def print_goals(ours: dict[str, dict[str, Any]], trl_r: dict[str, Any] | None, dtype: str = "bf16") -> None:
    """Issue 16's step goals, and the emulated-BF16 goal: ratio, goal, and the floor each ratio is taken
    against. With --dtype fp32 the bf16 recipe runs in plain FP32, so it is the fp32 floor."""
    step = {k: statistics.median(r["times"]) for k, r in ours.items()}
    gen = {k: statistics.median(r["gen"]) for k, r in ours.items()}
    if dtype == "fp32" and "bf16" in step and "fp32" not in step:
        step["fp32"], gen["fp32"] = step["bf16"], gen["bf16"]
    lines = []
    if "bf16" in step and trl_r:
        trl = statistics.median(trl_r["times"])
        lines.append(f"TRL / ours bf16 step          {trl / step['bf16']:6.2f}x   goal >= 2    (floor: ours bf16)")
    flags = recorded_flags() or "-"
    for k in (k for k in step if k.endswith("-emulated") and "fp32" in step):
        lines.append(f"{k + ' / ours fp32 step':<30}{step[k] / step['fp32']:6.2f}x   goal <= 1.15 (floor: fp32; "
                     f"CPU flags {flags})")
        lines.append(f"{k + ' / ours fp32 gen':<30}{gen[k] / gen['fp32']:6.2f}x   (reported)")
    for k in (k for k in step if k.startswith("fp8")):
        if "fp32" in step:
            lines.append(f"{k + ' / ours fp32 step':<30}{step[k] / step['fp32']:6.2f}x   goal <= 1.25 (floor: fp32)")
            lines.append(f"{k + ' / ours fp32 gen':<30}{gen[k] / gen['fp32']:6.2f}x   goal <= 1.25 (floor: fp32 gen)")
        if "bf16" in step:
            lines.append(f"{k + ' / ours bf16 step':<30}{step[k] / step['bf16']:6.2f}x   (reported)")
    if "fp32" in step and "bf16" in step:
        lines.append(f"{'fp32 / ours bf16 step':<30}{step['fp32'] / step['bf16']:6.2f}x   (the FP32 floor vs BF16)")
    print("\n".join(["goals (issue 16; emulated BF16):", *lines]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16, help="P: prompts per step")
    ap.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first, per side")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    ap.add_argument("--recipes", nargs="+", default=["bf16", "fp8_gen", "fp8_e2e", "fp32"],
                    help="recipes, fp32 (both engines FP32, no quantization), and <recipe>-emulated / "
                         "<recipe>-native (model.bf16_compute; e.g. bf16-emulated)")
    ap.add_argument("--before", action="store_true", help="add fp8 rows without issue 16's changes")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="model.dtype of every recipe: fp32 is the study's setting on CPUs without BF16 "
                         "hardware (then the bf16 recipe is the fp32 floor; pair with --no-trl-bf16)")
    ap.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True, help="run TRL (default)")
    ap.add_argument("--trl-bf16", action=argparse.BooleanOptionalAction, default=True,
                    help="TRL with BF16 autocast (default) or FP32")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time (with --threads 1: compute time on a shared machine)")
    ap.add_argument("--warmstart-steps", type=int, default=None, help="default: the run config's (>= 1)")
    ap.add_argument("--cache-dir", default=".fp8rl/warmstart", help="warm-start cache (shared with fp8rl-train)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5 deprecations inside TRL
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    cfg = run_config(args, args.recipes[0])
    ckpt = initial_checkpoint(cfg, load_tokenizer(cfg), make_task(cfg.task), progress=True)
    args.model_path = str(ckpt)  # every variant of ours starts from it
    versions = ""
    if args.trl:
        import transformers
        import trl

        versions = f"trl {trl.__version__}, transformers {transformers.__version__}, "
    print(f"P x G = {args.prompts} x {args.group}, max new tokens {args.max_new_tokens}, {args.steps} measured steps "
          f"after {args.warmup} warm-up, torch {torch.__version__} threads {torch.get_num_threads()}, "
          f"{versions}model {ckpt}")
    print(f"CPU flags {recorded_flags() or '-'}: model.bf16_compute auto -> {resolve_bf16_compute('auto', 'cpu')} here")
    names = list(args.recipes) + [f"{r} before" for r in args.recipes if args.before and r.startswith("fp8")]
    ours = time_ours(args, names)
    trl_r = time_trl(cfg, ckpt, ours[args.recipes[0]]["rng"], args) if args.trl else None
    base = statistics.median(trl_r["times"]) if trl_r else None
    print(f"{'implementation':<36} {'s/step':>9} {'gen s':>8} {'rest s':>9} {'tokens':>7} {'tokens/s':>9} "
          f"{'reward':>7} {'TRL/ours':>8} {'x first':>8}")
    if trl_r:
        print(row(f"TRL {'bf16' if args.trl_bf16 else 'fp32'}", trl_r, base))
    first = statistics.median(ours[args.recipes[0]]["times"])
    for recipe, r in ours.items():
        print(row(f"ours {recipe}", r, base, first))
    print_goals(ours, trl_r, args.dtype)
    print(f"load average (1, 5, 15 min): before {tuple(round(x, 2) for x in load0)}, "
          f"after {tuple(round(x, 2) for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
