"""Usage: PYTHONPATH=. python benchmarks/warmstart.py [--paths auto,fp32] [--steps 30] [--warmup 5]
                                                 [--threads N] [--target-steps S] [--cache-dir .fp8rl/warmstart]
                                                 [--set KEY=VALUE ...] [--startup]

Where the time of a study's warm start goes on this CPU (issue 35, item 6), every number measured in this run:
the supervised step of fp8rl_core/loop/warmstart.py (`sft_step`: forward under the warm start's autocast,
backward, clip, AdamW, schedule) on its own batches (`sft_batch`, batch_size examples), for each BF16 path:

  auto      model.bf16_compute auto as it resolves on this CPU (native with avx512_bf16 / amx_bf16, else
            emulated): the warm start a sweep trains here;
  emulated / native   that path, whatever the CPU;
  fp32      model.dtype fp32 (no autocast): the FP32 floor of the emulation, the same GEMMs without the casts.

Rows per path: the step (ms, ratio 1.00: the path's baseline); its parts from torch.profiler's self CPU
times over 3 steps (GEMMs: aten::mm/addmm/bmm; attention: SDPA forward and backward; optimizer: AdamW and
the clip's norms; the rest: norms, RoPE, SiLU, casts, loss, autograd), as shares of the step; the step's GEMMs
standalone (every linear's forward, dgrad and wgrad at the batch's M = batch_size x (T - 1) tokens, in the
path's GEMM dtype: BF16 for native, FP32 otherwise; one pass after each timed step, the best), the floor no
bit-identical change can beat, ratio = step / floor; building the batch (tokenizing, padding). Then the
dev-accuracy check (greedy decoding of dev_size prompts, every eval_every steps) and the projected warm start:
S steps x (the step + a batch) + S // eval_every checks, S = --target-steps, else the steps the cached warm
start of this config took (warmstart.txt under --cache-dir), else not projected.

--startup adds what every cell pays before its first step, in fresh interpreters (best of 3, ratio against a
bare `python -c pass`): torch, torch._dynamo (torch imports it itself, e.g. for a meta-device model), MLflow with
its SQL store, and the first query of an MLflow client on an existing SQLite store.

The CPU model, its kernel flags, the torch threads and what `auto` resolves to head the table; threads default
to torch's own (all cores), as the sweep's warm-start stage runs.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from fp8rl_core.config import load_run_config
from fp8rl_core.fp8 import calibrate, cpu_features
from fp8rl_core.loop import warmstart as ws_mod
from fp8rl_core.loop.builder import resolve_setup
from fp8rl_core.loop.setup import RunSetup
from fp8rl_core.model import bf16

PATH_KEYS = {"emulated": ["model.bf16_compute=emulated"], "native": ["model.bf16_compute=native"],
             "fp32": ["model.dtype=fp32"], "auto": []}
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def setup_for(path: str, overrides: list[str]) -> RunSetup:
    cfg = load_run_config(None, ["model.preset=tiny", *overrides, *PATH_KEYS[path]])
    return resolve_setup(cfg, "cpu")


def path_name(setup: RunSetup) -> str:
    return "fp32" if setup.compute_dtype == torch.float32 else ("emulated" if setup.warmstart_upcast_bf16 else "native")


def batches(setup: RunSetup, n: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """n warm-start batches in the warm start's order, and the seconds building one took (mean)."""
    ws, rng = setup.cfg.warmstart, random.Random(setup.cfg.task.data_seed + 1)
    t0 = time.perf_counter()
    out = [ws_mod.sft_batch(setup.task.warmstart_sample(rng, ws.batch_size), setup.tokenizer, setup.task)
           for _ in range(n)]
    return out, (time.perf_counter() - t0) / n


def trainer(setup: RunSetup):
    """The warm start's model, optimizer, schedule and autocast, as warm_start builds them."""
    model = ws_mod.initial_model(setup)
    opt, sched = ws_mod.sft_optimizer(model, setup.cfg.warmstart)
    return model, opt, sched, ws_mod.sft_autocast(setup)


def step_seconds(setup: RunSetup, data: list, warmup: int, tokens: int, gemm_dtype: torch.dtype
                 ) -> tuple[float, float, dict[str, float], torch.nn.Module]:
    """Median seconds of a step after `warmup` steps; best seconds of the step's GEMMs alone (gemm_pass), one pass
    after each timed step, so that both see the same load on a shared machine; the profiled shares of the parts."""
    model, opt, sched, autocast = trainer(setup)
    floor_pass = gemm_pass(model, tokens, gemm_dtype)
    floor_pass()  # the GEMM library's first calls
    times, floors = [], []
    for i, (ids, mask) in enumerate(data):
        t0 = time.perf_counter()
        ws_mod.sft_step(model, opt, sched, ids, mask, autocast).item()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            floor_pass()
            floors.append(time.perf_counter() - t0)
    from torch.profiler import profile

    with profile() as prof:
        for ids, mask in data[warmup:warmup + 3]:
            ws_mod.sft_step(model, opt, sched, ids, mask, autocast).item()
    return statistics.median(times), min(floors), shares(prof.key_averages()), model


def shares(events) -> dict[str, float]:
    """Self CPU time per part (GEMMs, attention, optimizer, rest) as fractions of the total."""
    parts = {"GEMMs": 0.0, "attention": 0.0, "optimizer": 0.0, "rest": 0.0}
    opt_total = sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step"))
    clip = sum(e.self_cpu_time_total for e in events if e.key in ("aten::linalg_vector_norm", "aten::_foreach_norm"))
    for e in events:
        if e.key in GEMM_OPS:
            parts["GEMMs"] += e.self_cpu_time_total
        elif "scaled_dot_product" in e.key:
            parts["attention"] += e.self_cpu_time_total
    total = sum(e.self_cpu_time_total for e in events)
    parts["optimizer"] = opt_total + clip
    parts["rest"] = max(total - parts["GEMMs"] - parts["attention"] - parts["optimizer"], 0.0)
    return {k: v / total for k, v in parts.items()}


def gemm_pass(model: torch.nn.Module, tokens: int, dtype: torch.dtype):
    """A callable running the step's linear GEMMs alone: forward x w^T, dgrad dy w, wgrad dy^T x per linear."""
    shapes = [(m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    ops = []
    for k, n in shapes:
        x, w, dy = (torch.randn(tokens, k, dtype=dtype), torch.randn(n, k, dtype=dtype),
                    torch.randn(tokens, n, dtype=dtype))
        ops.append(lambda x=x, w=w, dy=dy: (x @ w.t(), dy @ w, dy.t() @ x))
    return lambda: [op() for op in ops]


def dev_check_seconds(setup: RunSetup, model: torch.nn.Module) -> float:
    dev = ws_mod.dev_examples(setup.cfg, setup.task)
    t0 = time.perf_counter()
    ws_mod.dev_accuracy(model, setup, dev)
    return time.perf_counter() - t0


def cached_steps(setup: RunSetup) -> int | None:
    """Steps the cached warm start of this config took (warmstart.txt), None if not cached."""
    done = Path(setup.cfg.warmstart.cache_dir) / ws_mod.warmstart_key(setup.cfg) / "warmstart.txt"
    if not done.exists():
        return None
    fields = dict(kv.split("=") for kv in done.read_text().split())
    return int(float(fields["steps"]))


def path_rows(path: str, args: argparse.Namespace) -> list[tuple]:
    setup = setup_for(path, args.set)
    name, ws = path_name(setup), setup.cfg.warmstart
    data, batch_s = batches(setup, args.warmup + args.steps)
    tokens = ws.batch_size * (int(statistics.median(ids.shape[1] for ids, _ in data)) - 1)  # M of the GEMMs
    step_s, floor, part, model = step_seconds(setup, data, args.warmup, tokens,
                                              torch.bfloat16 if name == "native" else torch.float32)
    label = f"[{path}: {name}]" if path == "auto" else f"[{name}]"
    rows = [(f"warm-start step {label}", step_s, 1.0,
             f"batch {ws.batch_size}, {tokens} tokens, median of {args.steps}")]
    rows += [(f"  {k} (profiler share)", step_s * v, v, "") for k, v in part.items()]
    rows.append((f"  GEMM floor: the step's GEMMs alone ({'bf16' if name == 'native' else 'fp32'})", floor,
                 step_s / floor, "ratio = step / floor"))
    rows.append(("  building the batch", batch_s, batch_s / step_s, "ratio = / step"))
    check_s = dev_check_seconds(setup, model)
    rows.append((f"dev check {label} ({ws.dev_size} prompts, greedy)", check_s, check_s / step_s,
                 f"every {ws.eval_every} steps; ratio = / step"))
    steps = args.target_steps or cached_steps(setup)
    if steps:
        total = steps * (step_s + batch_s) + steps // ws.eval_every * check_s
        src = "--target-steps" if args.target_steps else "the cached warm start of this config"
        rows.append((f"projected warm start {label}: {steps} steps", total, total / (steps * floor),
                     f"{total / 60:.1f} min; steps from {src}; ratio = / (steps x GEMM floor)"))
    return rows


STARTUP = {
    "python -c pass": "pass",
    "import torch": "import torch",
    "import torch, torch._dynamo": "import torch, torch._dynamo",
    "import mlflow + SQL store": "import mlflow, mlflow.store.tracking.sqlalchemy_store",
    "MLflow client: first query (SQLite)": "from mlflow import MlflowClient; MlflowClient('sqlite:///{db}').search_experiments()",
}


def startup_rows() -> list[tuple]:
    """Best-of-3 seconds of each STARTUP snippet in a fresh interpreter, ratio against `python -c pass`."""
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "mlflow.db"
        subprocess.run([sys.executable, "-c", STARTUP["MLflow client: first query (SQLite)"].format(db=db)],
                       check=True, capture_output=True)  # the tables exist, as in a sweep's store
        best = {}
        for name, code in STARTUP.items():
            runs = []
            for _ in range(3):
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-c", code.format(db=db)], check=True, capture_output=True)
                runs.append(time.perf_counter() - t0)
            best[name] = min(runs)
    base = best["python -c pass"]
    return [(f"fresh process: {k}", v, v / base, "ratio = / python -c pass") for k, v in best.items()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="auto,fp32", help=f"comma list of {', '.join(PATH_KEYS)}")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per path")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default, as the sweep's stage)")
    ap.add_argument("--target-steps", type=int, default=None, help="steps the projection assumes")
    ap.add_argument("--cache-dir", default=None, help="the warm-start cache (default: the run config's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a run-config override")
    ap.add_argument("--startup", action="store_true", help="add the per-process startup rows")
    args = ap.parse_args(argv)
    bad = [p for p in args.paths.split(",") if p not in PATH_KEYS]
    if bad:
        ap.error(f"--paths: {bad[0]!r} is not a path; valid: {', '.join(PATH_KEYS)}")
    if args.cache_dir:
        args.set.append(f"warmstart.cache_dir={args.cache_dir}")
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    print(f"# CPU {calibrate.cpu_model()}, kernel flags {cpu_features.kernel_flags()}, BF16 dot products: "
          f"{'yes' if bf16.has_bf16_dot() else 'no'}; "
          f"model.bf16_compute auto -> {bf16.resolve_bf16_compute('auto', 'cpu')}")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, wall clock")
    rows = [r for p in args.paths.split(",") for r in path_rows(p, args)]
    rows += startup_rows() if args.startup else []
    print(f"| {'case':<62} | {'ms':>11} | {'ratio':>6} | note")
    print(f"|{'-' * 64}|{'-' * 13}|{'-' * 8}|-----")
    for name, t, ratio, note in rows:
        print(f"| {name:<62} | {t * 1e3:11.1f} | {ratio:6.2f} | {note}")
    print(f"# load average (1, 5, 15 min): before {tuple(round(v, 2) for v in load0)}, "
          f"after {tuple(round(v, 2) for v in os.getloadavg())} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
