"""Scaling of one cell over ranks on this machine: tokens/s and peak memory per rank at world size 1 and 2.

    python benchmarks/scaling.py                        # tiny + hidden 1024, bf16 + fp8_e2e, W = 1, 2
    python benchmarks/scaling.py --models tiny --recipes bf16 --steps 3
    python benchmarks/scaling.py --models hidden1024 --recipes fp8_e2e --set train.micro_batch_size=4 \
        --variants "" "parallel.grad_reduce=step,parallel.reshard_after_forward=false"

Each cell is a real `torchrun --standalone --nproc-per-node W -m fp8rl_core.cli` run (one thread per
rank) from a random-init model folder (no warm start). `--variants`: comma lists of run-config
overrides, each measured at W > 1 against one W = 1 run per recipe ("" = the defaults). Reported per row:
  tokens/s     median over steps 2.. of the run's `tokens_per_s` (global: all ranks' response tokens
               per second of step wall time); efficiency = tokens/s(W) / (W x tokens/s(1))
  step/gen/train s  medians of the step's wall time, its generation (the slowest rank's) and its
               training + refit time (train_time_s): where a W > 1 step loses its time
  peak_rss     the largest rank's peak RSS (ru_maxrss of torchrun's children), MiB
  param+optim  bytes of this rank's parameters + AdamW states after one step, measured on the
               sharded trainer (FSDP2 at W > 1), and the memory plan's figure for the same
The floor line: one all-gather and one reduce-scatter of the whole FP32 model over gloo, measured
here, the unit FSDP2's traffic per step is counted in.
Goals (issue 12): efficiency >= 0.8 at hidden 1024; param+optim(2) <= 0.6 x param+optim(1).
A table, not a test: the numbers depend on the machine; only ratios measured in one run compare.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from fp8rl_core.model.config import ModelConfig

MODELS = {
    "tiny": ModelConfig(),
    "hidden1024": ModelConfig(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16,
                              num_key_value_heads=8),
}
ROLLOUT = ["rollout.prompts_per_step=8", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=16"]


def model_folder(name: str, root: Path) -> Path:
    """A random-init HF folder of MODELS[name] (the char tokenizer's 32-token vocabulary)."""
    from fp8rl_core.model import build_model, save_pretrained

    path = root / f"model_{name}"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        save_pretrained(build_model(MODELS[name]), path)
    return path


def run_cell(model: Path, recipe: str, world: int, steps: int, out: Path, extra: tuple[str, ...] = ()
             ) -> dict[str, float]:
    """One torchrun run; its median tokens/s (steps 2..) and the largest rank's peak RSS in MiB."""
    overrides = [f"model.path={model}", f"recipe={recipe}", f"output_dir={out}", f"train.steps={steps}",
                 "train.val_every=100000", "train.val_samples=0", "task.val_size=4", "threads=1",
                 "train.checkpoint_every=100000", *ROLLOUT, *extra]  # extra last: --set may change the rollout
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "fp8rl_core.cli", "--no-progress", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shutil.rmtree(out, ignore_errors=True)  # a finished run left here would only resume and exit
    # a wrapper process per cell: RUSAGE_CHILDREN's max RSS is then this cell's largest rank, not the max
    # over every cell run so far
    wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL);"
               " print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    done = subprocess.run([sys.executable, "-c", wrapper, *cmd], check=True, env=env, capture_output=True, text=True)
    peak_kib = int(done.stdout.strip().splitlines()[-1])
    steps = [rec["values"] for rec in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if rec.get("kind") == "metrics" and rec["step"] >= 2 and "tokens_per_s" in rec["values"]]
    med = lambda f: statistics.median(f(v) for v in steps)  # noqa: E731
    gen_s = med(lambda v: v["step_time_s"] * v["tokens_per_s"] / v["generation_tokens_per_s"])
    return {"tokens_per_s": med(lambda v: v["tokens_per_s"]), "peak_rss_mib": peak_kib / 1024,
            "step_s": med(lambda v: v["step_time_s"]), "gen_s": gen_s, "train_s": med(lambda v: v["train_time_s"])}


def _state_bytes_worker(rank: int, world: int, port: int, name: str, out: str) -> None:
    """This rank's parameter + AdamW bytes after one step of the (sharded) native trainer."""
    import torch.distributed as dist

    from fp8rl_core.distributed.mesh import SINGLE
    from fp8rl_core.engines.base import TrainBatch
    from fp8rl_core.engines.native_train import NativeTrainingEngine
    from fp8rl_core.model import build_model

    torch.set_num_threads(1)
    mesh = SINGLE
    if world > 1:
        from fp8rl_core.distributed.env import _mesh

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = _mesh(rank, world, rank, "cpu")
    torch.manual_seed(0)
    eng = NativeTrainingEngine(build_model(MODELS[name]), mesh=mesh)
    ids = torch.randint(3, 32, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.bool)
    eng.train_step(TrainBatch(input_ids=ids, attention_mask=mask, response_mask=mask, advantages=torch.ones(2, 8)))
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).numel() * t.element_size()  # noqa: E731
    n = sum(local(p) for p in eng.model.parameters())
    n += sum(local(v) for st in eng.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim())
    if rank == 0:
        Path(out).write_text(str(n))
    if world > 1:
        dist.destroy_process_group()


def spawn_ranks(worker, world: int, *args) -> str:
    """worker(rank, world, port, *args, out) on `world` gloo ranks; returns what rank 0 wrote to `out`."""
    import torch.multiprocessing as mp

    from fp8rl_core.io.ports import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        mp.spawn(worker, args=(world, free_port(), *args, out), nprocs=world, join=True)
        return Path(out).read_text()


def state_bytes(name: str, world: int) -> int:
    return int(spawn_ranks(_state_bytes_worker, world, name))


def _collectives_worker(rank: int, world: int, port: int, numel: int, out: str) -> None:
    """Seconds of one all-gather and one reduce-scatter of `numel` FP32 values (the model) over gloo."""
    import time

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shard = -(-numel // world)
    full, part = torch.empty(shard * world), torch.randn(shard)
    gather, scatter = [], []
    for _ in range(4):  # the first of each is a warm-up
        dist.barrier()
        t = time.perf_counter()
        dist.all_gather_single(full, part)
        gather.append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        dist.reduce_scatter_single(part, full)
        scatter.append(time.perf_counter() - t)
    if rank == 0:
        Path(out).write_text(json.dumps([min(gather[1:]), min(scatter[1:])]))
    dist.destroy_process_group()


def collective_seconds(name: str, world: int) -> tuple[float, float]:
    """(all-gather, reduce-scatter) seconds of the whole FP32 model at `world` ranks: FSDP2's unit of traffic."""
    from fp8rl_core.distributed.memory_plan import count_parameters

    gather, scatter = json.loads(spawn_ranks(_collectives_worker, world, count_parameters(MODELS[name]).total))
    return gather, scatter


def planned_state_bytes(name: str, world: int) -> int:
    from fp8rl_core.distributed.memory_plan import Layout, plan_memory

    plan = plan_memory(MODELS[name], Layout(world_size=world))
    return plan.device["params"] + plan.device["optimizer"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--recipes", nargs="+", default=["bf16", "fp8_e2e"])
    ap.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--workdir", default=None, help="where model folders and runs go (default: a temp folder)")
    ap.add_argument("--set", nargs="*", default=[], dest="common",
                    help="run-config overrides for every run, e.g. train.micro_batch_size=4")
    ap.add_argument("--variants", nargs="+", default=[""],
                    help='comma lists of run-config overrides measured at W > 1 ("" = defaults)')
    args = ap.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="fp8rl-scaling-"))
    print("| model | recipe | W | overrides | tokens/s | efficiency | step s | gen s | train s | peak RSS/rank MiB "
          "| param+optim/rank MiB (plan) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    variants = [tuple(v for v in text.split(",") if v) for text in args.variants]
    if args.common:
        print(f"every run: {' '.join(args.common)}")
    for name in args.models:
        folder = model_folder(name, root)
        states = {w: state_bytes(name, w) for w in args.worlds}
        for recipe in args.recipes:
            base = None
            for w in args.worlds:
                for extra in variants if w > 1 else [()]:
                    tag = "_".join(x.replace("=", "-") for x in extra)
                    r = run_cell(folder, recipe, w, args.steps, root / f"run_{name}_{recipe}_{w}_{tag}",
                                 (*args.common, *extra))
                    base = base or r["tokens_per_s"] / w
                    eff = r["tokens_per_s"] / (w * base)
                    print(f"| {name} | {recipe} | {w} | {' '.join(extra) or '-'} | {r['tokens_per_s']:.0f} | {eff:.2f} "
                          f"| {r['step_s']:.2f} | {r['gen_s']:.2f} | {r['train_s']:.2f} "
                          f"| {r['peak_rss_mib']:.0f} | {states[w] / 2**20:.1f} "
                          f"({planned_state_bytes(name, w) / 2**20:.1f}) |", flush=True)
        if len(args.worlds) > 1:
            w0, w1 = args.worlds[0], args.worlds[1]
            print(f"|  | param+optim ratio W={w1}/W={w0} | | | | | | | | | {states[w1] / states[w0]:.2f} |")
            gather, scatter = collective_seconds(name, w1)
            print(f"\nfloor at W={w1} ({name}): one all-gather of the FP32 model {gather * 1e3:.0f} ms, one "
                  f"reduce-scatter {scatter * 1e3:.0f} ms (gloo, this machine). Per step FSDP2 runs, per "
                  "micro-batch, 2 all-gathers (forward, backward) + 1 reduce-scatter by default; with "
                  "reshard_after_forward=false and grad_reduce=step, 1 all-gather + 1 reduce-scatter per step; "
                  "plus 1 all-gather per log-prob pass and per refit.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
