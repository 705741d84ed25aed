"""The device check for a lent GPU (one H200, one call of at most 6 minutes): six phases, rows written as they finish.

Usage: python benchmarks/gpu_check.py [--out-dir DIR] [--phases env,preflight,...] [--deadline 300]
                                      [--budgets grpo=120,...] [--strict] [--cpu] [options below]
       bash benchmarks/device_check.sh [--cpu] OUT_DIR      # the one command for the lent machine (README there)

Phases, in order (benchmarks/gpu_phases/<name>.py holds each, its docstring the details):
  env        versions, the GPU and its capabilities, which imports work (mlflow, submitit, pytest, vLLM,
             Transformer Engine and Megatron must not be imported by the check's chain: the machine has none),
             and what is out of its reach (vLLM's and Transformer Engine's GPU paths; the header says it too)
  preflight  select_executor (scaled_mm on SM90), the 8B sweep's FP8 GEMM shapes against the exact emulation
             under the bound, each timed against BF16; fp8rl_core.fp8.preflight over the ~1B policy's GEMM
             shapes eager and compiled, and the blockwise GEMM at 4096^3 against BF16 and against the emulation
  linear     Fp8Linear forward + backward vs BF16 nn.Linear at 4096^3, quantization included, eager and compiled
  grpo       a GRPO step per recipe (bf16, fp8_gen, fp8_e2e) on a random-init ~1B Llama: time per phase,
             token_mult_prob_error, CUDA peak memory against memory_plan's estimate
  fsdp       FSDP2 on a one-rank NCCL mesh against the unsharded engine, and a DCP save + load
  megatron   Megatron-Core BF16 (local spec) against the native engine, where megatron-core is installed
--cpu (alias --allow-cpu): the same phases at tiny sizes on the CPU (gloo, the emulated executor, the
aot_eager compile backend): the smoke CI runs (tests/benchmarks/test_device_check.py).

Output: each row is appended the moment it is made to DIR/device_check.jsonl (one JSON object per line:
phase, case, status, the numeric columns, note, data) and DIR/device_check.md (a Markdown table), flushed
and fsynced, so a run killed at any instant keeps every finished row; a completed run ends with a row of
phase `end`. status: ok | fail (ran, a check failed) | error (raised; traceback on stderr) | skipped (why).
A crash (a segfault, an abort: a process death no row can report) ends one process; device_check.sh then
starts another with --resume, which writes an error row for the case that died and goes on with the next phase.
Time: an overall --deadline counted from the process's start (default 300 s: the 6-minute call less a
margin; device_check.sh kills the process at 340 s) and per-phase --budgets; a case starts only while both
have MIN_START_S left, otherwise it is a `skipped` row naming the limit. Without CUDA (and no --cpu) it
says so and exits 0 having run nothing. Exit status 0 unless --strict and a row is `fail` or `error`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from argparse import Namespace
from pathlib import Path
from typing import Any

START = time.monotonic()  # the deadline counts from here: importing torch and starting CUDA take its time too
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import torch  # noqa: E402
from gpu_phases import env, fsdp, gemm, grpo, linear, megatron  # noqa: E402
from gpu_phases.common import MIN_START_S, Clock, Report, Run, row  # noqa: E402

PHASES = {"env": env.run, "preflight": gemm.run, "linear": linear.run, "grpo": grpo.run, "fsdp": fsdp.run,
          "megatron": megatron.run}
DEFAULT_DEADLINE_S = 300.0
# each phase's cap in seconds; together a little under the deadline, so that every phase gets its turn
DEFAULT_BUDGETS = {"env": 15.0, "preflight": 45.0, "linear": 50.0, "grpo": 100.0, "fsdp": 40.0, "megatron": 40.0}
# (GPU, --cpu) defaults of the size options
SIZES = {
    "sizes": ([4096], [128]),
    "gemm_size": (4096, 256),
    "repeats": (5, 1),
    "compile_backend": ("inductor", "aot_eager"),
    "prompts": (16, 2),
    "samples": (8, 2),
    "new_tokens": (32, 4),
    "preflight_ms": ([126, 4096], [4, 64]),
    "preflight_compiled_ms": ([126, 4096], [4]),
    "preflight_compiled_max": (0, 3),
    "threads": (8, 1),
}
__all__ = ["DEFAULT_BUDGETS", "MIN_START_S", "Clock", "main", "parse_budgets"]


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None) -> Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", "--allow-cpu", dest="cpu", action="store_true",
                    help="the CPU smoke: tiny sizes, gloo, the emulated executor (even where CUDA exists)")
    ap.add_argument("--out-dir", type=Path, help="append device_check.jsonl and device_check.md here, row by row")
    ap.add_argument("--out", type=Path, help="also write every row as one JSON document at the end")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    ap.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                    help=f"overall seconds; no case starts later (default {DEFAULT_DEADLINE_S:.0f})")
    ap.add_argument("--budgets", default="", help="per-phase seconds, e.g. grpo=90,linear=30 (defaults: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in DEFAULT_BUDGETS.items()) + ")")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any row is fail or error")
    ap.add_argument("--resume", type=int, metavar="EXIT_STATUS",
                    help="go on after a run that died with this exit status: keep --out-dir's rows, write an error "
                         "row for the phase it died in, run the phases after it (device_check.sh does this)")
    ap.add_argument("--executor", help="FP8 GEMM executor under test (default: $FP8RL_GEMM, else the best here)")
    ap.add_argument("--sizes", type=ints, help="linear: M = K = N list (GPU 4096; --cpu 128)")
    ap.add_argument("--gemm-size", type=int, help="preflight: M = K = N of the timed GEMM (GPU 4096; --cpu 256)")
    ap.add_argument("--preflight-ms", type=ints, help="preflight: decode- and training-sized M (GPU 126,4096: 126 "
                    "is not a multiple of 4, the padded path; --cpu 4,64)")
    ap.add_argument("--preflight-compiled-ms", type=ints, help="preflight compiled: the M values (GPU 126,4096; "
                    "--cpu 4: a compile per shape)")
    ap.add_argument("--preflight-compiled-max", type=int, help="preflight compiled: at most this many shapes "
                    "(GPU 0: all, the phase budget permitting; --cpu 3)")
    ap.add_argument("--repeats", type=int, help="timed repeats, best of (GPU 5, --cpu 1)")
    ap.add_argument("--compile-backend", help="torch.compile backend (GPU inductor, --cpu aot_eager)")
    ap.add_argument("--recipes", nargs="+", default=["bf16", "fp8_gen", "fp8_e2e"])
    ap.add_argument("--steps", type=int, default=2, help="grpo: measured steps per recipe")
    ap.add_argument("--warmup", type=int, default=1, help="grpo: unmeasured steps first")
    ap.add_argument("--prompts", type=int, help="grpo: prompts per step (GPU 16, --cpu 2)")
    ap.add_argument("--samples", type=int, help="grpo: samples per prompt (GPU 8, --cpu 2)")
    ap.add_argument("--new-tokens", type=int, help="grpo: max new tokens (GPU 32, --cpu 4)")
    ap.add_argument("--threads", type=int, help="torch threads (GPU 8, --cpu 1)")
    args = ap.parse_args(argv)
    for key, (gpu, cpu) in SIZES.items():
        if getattr(args, key) is None:
            setattr(args, key, cpu if args.cpu else gpu)
    args.phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    args.requested = list(args.phases)  # args.phases: what this process runs (--resume starts later)
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        raise SystemExit(f"--phases: unknown {', '.join(unknown)}; valid: {', '.join(PHASES)}")
    args.budgets = parse_budgets(args.budgets)
    return args


def parse_budgets(text: str) -> dict[str, float]:
    """'grpo=90,linear=30' -> every phase's budget, the ones not named at their default."""
    out = dict(DEFAULT_BUDGETS)
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        if key not in DEFAULT_BUDGETS or not value:
            raise SystemExit(f"--budgets: {item!r}; expected phase=seconds with phase in {', '.join(DEFAULT_BUDGETS)}")
        out[key] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.cpu:
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing was run. "
              "Run it on a GPU machine, or with --cpu for a tiny CPU smoke of the same code paths.")
        print(f"skipped: phases {', '.join(args.phases)}: no CUDA GPU (torch {torch.__version__})")
        if args.out_dir:
            Report(args.out_dir, "device check: no CUDA GPU").add(
                [row("env", "device", "skipped", note="no CUDA GPU: nothing was run (--cpu runs the CPU smoke)")])
        if args.out:
            args.out.write_text(json.dumps({"torch": torch.__version__, "cuda": False, "rows": [],
                                            "skipped": "no CUDA"}, indent=2) + "\n")
        return 0
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    what = "CPU smoke (--cpu)" if args.cpu else torch.cuda.get_device_name(device)
    limits = (f"Deadline {args.deadline:.0f} s; phase budgets "
              + ", ".join(f"{k} {v:.0f} s" for k, v in args.budgets.items()) + ".\n\n" + env.out_of_reach()[0])
    report = Report(args.out_dir, f"device check: torch {torch.__version__}, {what}, phases {', '.join(args.phases)}",
                    preamble=limits, resume=args.resume is not None)
    clock = Clock(args.deadline, args.budgets, t0=START)
    if args.resume is not None:
        args.phases = after_crash(args, report)
    with tempfile.TemporaryDirectory(prefix="fp8rl-device-check-") as tmp:
        run = Run(args=args, device=device, clock=clock, report=report, work=Path(tmp))
        for name in args.phases:
            t0 = time.perf_counter()
            PHASES[name](run)
            print(f"# phase {name} done in {time.perf_counter() - t0:.0f} s", flush=True)
    return finish(args, report, clock)


def after_crash(args: Namespace, report: Report) -> list[str]:
    """The phases left after the one a crashed run died in; that one gets an error row naming the case."""
    running = report.running()
    done = [r["phase"] for r in report.rows if r["phase"] in PHASES]
    died, case = running if running and running[0] in PHASES else ((done or args.phases)[-1 if done else 0], "?")
    finished = any(r["phase"] == died and r["case"] == case for r in report.rows)  # died between cases
    signal = f"signal {args.resume - 128}" if args.resume > 128 else f"exit status {args.resume}"
    report.add([row(died, f"process died {'after' if finished else 'in'}: {case}", "error",
                    note=f"the check's process died ({signal}); the rest of phase {died} was not run, "
                         "the check went on with the next phase (device_check.sh)")])
    return args.phases[args.phases.index(died) + 1:] if died in args.phases else args.phases


def finish(args: Namespace, report: Report, clock: Clock) -> int:
    elapsed = clock.now() - clock.t0
    counts = {s: sum(r["status"] == s for r in report.rows) for s in ("ok", "fail", "error", "skipped")}
    report.add([row("end", "total", time_ms=elapsed * 1e3,
                    note=", ".join(f"{v} {k}" for k, v in counts.items()) + f"; deadline {args.deadline:.0f} s",
                    data=counts)])
    not_selected = [p for p in PHASES if p not in args.requested]
    report.text(f"\ntotal {elapsed:.0f} s (deadline {args.deadline:.0f} s)")
    skipped = [r for r in report.rows if r["status"] == "skipped"]
    if skipped or not_selected:
        report.text("skipped:\n" + "\n".join([f"- phase {p}: not selected (--phases)" for p in not_selected]
                                             + [f"- [{r['phase']}] {r['case']}: {r['note']}" for r in skipped]))
    if args.out:
        doc: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "rows": report.rows,
                               "elapsed_s": elapsed, "deadline_s": args.deadline, "budgets": args.budgets,
                               "phases_not_selected": not_selected}
        args.out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return 1 if args.strict and (counts["fail"] or counts["error"]) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
