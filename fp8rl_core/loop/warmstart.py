"""Supervised warm start: RL needs a policy whose reward is not zero.

The tiny preset is trained briefly (cross-entropy on the answer + EOS) on the task's warm-start
distribution and saved as an HF checkpoint under `<cache_dir>/<key>/`, where key hashes the model,
task and warm-start config. Every cell of a sweep thus starts from the same weights (a fair
ablation), and the stage runs once: later calls, from any process, find the finished folder. A file
lock serialises concurrent first calls; the folder appears by an atomic rename, complete or not at all.
"""
from __future__ import annotations

import fcntl
import math
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from fp8rl_core.config import RunConfig
from fp8rl_core.config.schema import stable_hash, to_dict
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.loop.evaluate import greedy_accuracy
from fp8rl_core.loop.setup import RunSetup
from fp8rl_core.model import bf16, build_model, save_pretrained
from fp8rl_core.model.config import preset


def warmstart_key(cfg: RunConfig) -> str:
    ws, model, task = to_dict(cfg.warmstart), to_dict(cfg.model), to_dict(cfg.task)
    ws.pop("cache_dir")
    model.pop("bf16_compute")  # summation order only (like threads): one warm start for both BF16 paths
    if not task["scratchpad"]:
        task.pop("scratchpad")  # added later: the key of every warm start without it stays as it was
    return stable_hash({"model": model, "task": task, "warmstart": ws})


def sft_batch(examples: list, tokenizer: Any, task: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids Long[B, T] (right-padded), loss_mask Bool[B, T] on target tokens and EOS."""
    rows, masks = [], []
    for ex in examples:
        prompt, target = task.sft_text(ex)
        p = tokenizer.encode(prompt)
        t = tokenizer.encode(target, add_bos=False) + [tokenizer.eos_id]
        rows.append(p + t)
        masks.append([False] * len(p) + [True] * len(t))
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), tokenizer.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.bool)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(m)] = torch.tensor(m)
    return ids, mask


def sft_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over masked positions: position t predicts ids[:, t]."""
    logits = model(ids[:, :-1]).float()  # right padding: causal attention never sees it
    target = ids[:, 1:]
    m = mask[:, 1:]
    return F.cross_entropy(logits[m], target[m])


def dev_examples(cfg: RunConfig, task: Any) -> list:
    """The warm start's stopping set: `dev_size` training-distribution prompts (never validation ones),
    drawn from their own seed so that they do not shift the training stream."""
    return task.sample_train(random.Random(cfg.task.data_seed + 2), cfg.warmstart.dev_size)


def dev_accuracy(model: torch.nn.Module, setup: RunSetup, examples: list) -> float:
    """Greedy exact-match accuracy of `model` on `examples`, decoded by a BF16 generation engine on the CPU."""
    gen = NativeGenerationEngine(model.config, dtype=setup.compute_dtype, device="cpu", seed=0,
                                 upcast_bf16=setup.warmstart_upcast_bf16)
    gen.refit(model.state_dict())
    return greedy_accuracy(gen, setup.tokenizer, setup.task, examples, setup.cfg.rollout.max_new_tokens)


def sft_optimizer(model: torch.nn.Module, ws: Any) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW at `ws.lr` (no weight decay) and its schedule: linear warmup over `ws.steps // 20` steps, then a
    cosine decay to 10% at `ws.steps` (ws: the run config's WarmStartSpec)."""
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.0)
    warmup = max(1, ws.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * min(s / ws.steps, 1.0))))
    return opt, sched


def sft_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, ids: torch.Tensor,
             mask: torch.Tensor, autocast: Any) -> torch.Tensor:
    """One supervised update: sft_loss under `autocast`, backward, gradient norm clipped to 1.0, the optimizer
    and schedule steps. Returns the loss (a 0-dim tensor, before the update)."""
    with autocast:
        value = sft_loss(model, ids, mask)
    opt.zero_grad(set_to_none=True)
    value.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return value


def sft_autocast(setup: RunSetup) -> Any:
    """The warm start's autocast: BF16 when the run computes in BF16 (model.dtype), else off."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=setup.compute_dtype == torch.bfloat16)


def initial_model(setup: RunSetup) -> torch.nn.Module:
    """The warm start's starting point: the preset in FP32, initialized from the task's data seed, its BF16
    products emulated where the warm start's BF16 path (resolved on the CPU, where it trains) says so (same
    parameters and state_dict: the checkpoint is unchanged)."""
    torch.manual_seed(setup.cfg.task.data_seed)
    model = build_model(preset(setup.cfg.model.preset, vocab_size=max(32, setup.tokenizer.vocab_size)),
                        dtype=torch.float32)
    if setup.warmstart_upcast_bf16:
        bf16.upcast_bf16_matmuls(model)
    return model


def _train(model: torch.nn.Module, setup: RunSetup, progress: bool) -> dict[str, float]:
    """Supervised steps until `steps`, or until greedy dev accuracy >= `target_accuracy` (checked every
    `eval_every` steps). Why a target: the tiny model learns carries in a sudden drop of the loss whose
    step moves by >1000 steps with tiny numeric changes (thread count, kernels), so a fixed length
    gives RL a very different starting policy from one machine to the next; a target does not.
    Returns {"steps", "final_loss", "dev_accuracy"} (NaN where not measured)."""
    cfg, tokenizer, task = setup.cfg, setup.tokenizer, setup.task
    ws = cfg.warmstart
    done = {"steps": 0, "final_loss": float("nan"), "dev_accuracy": float("nan")}
    if ws.steps == 0:  # RL straight from the initialization (e.g. for benchmarks)
        return done
    rng = random.Random(cfg.task.data_seed + 1)
    dev = dev_examples(cfg, task) if ws.target_accuracy is not None else []
    opt, sched = sft_optimizer(model, ws)
    autocast = sft_autocast(setup)
    bar = tqdm(range(ws.steps), desc="warm start", disable=not progress, mininterval=2.0)
    for step in bar:
        ids, mask = sft_batch(task.warmstart_sample(rng, ws.batch_size), tokenizer, task)
        value = sft_step(model, opt, sched, ids, mask, autocast)
        done.update(steps=step + 1, final_loss=value.item())
        if dev and (step + 1) % ws.eval_every == 0:
            done["dev_accuracy"] = dev_accuracy(model, setup, dev)
        bar.set_postfix(loss=f"{done['final_loss']:.3f}", dev_acc=f"{done['dev_accuracy']:.3f}", refresh=False)
        if done["dev_accuracy"] >= (ws.target_accuracy if dev else math.inf):
            break
    return done


def warm_start(setup: RunSetup, progress: bool = True) -> Path:
    """Path of the warm-start HF checkpoint of the setup's config, training it first if no process has yet."""
    cfg, tokenizer = setup.cfg, setup.tokenizer

    root = Path(cfg.warmstart.cache_dir)
    final = root / warmstart_key(cfg)
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be training the same key right now
        if (final / "config.json").exists():
            return final
        model = initial_model(setup)
        done = _train(model, setup, progress)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        save_pretrained(model, tmp, tokenizer=tokenizer)
        (tmp / "warmstart.txt").write_text(" ".join(f"{k}={v:.4g}" for k, v in done.items()) + "\n")
        tmp.rename(final)
    return final
