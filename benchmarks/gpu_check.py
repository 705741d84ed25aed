"""One device check for a lent GPU (an H200, well within 8 minutes): FP8 GEMMs, GRPO steps, optional backends.

Usage: python benchmarks/gpu_check.py [--out gpu_check.json] [--executor scaled_mm] [--sections a,b,c]
                                      [--sizes 4096,1024] [--repeats 5] [--recipes bf16 fp8_gen fp8_e2e]
                                      [--warmstart-steps 200] [--steps 2] [--backend-timeout 300]
                                      [--deadline 480] [--budgets a=90,b=150,c=240]
       python benchmarks/gpu_check.py --allow-cpu      # tiny sizes on the CPU: the same code paths, for tests

Time: an overall --deadline (default 480 s, under the 8 minutes a lent GPU gives one command) and
per-section --budgets (seconds; default a=90, b=150, c=240). A case starts only while both its
section's budget and the overall deadline have at least MIN_START_S left; otherwise it becomes a
`skipped` row saying which limit stopped it, and the backend subprocesses of section c get the time
that is left as their timeout (at most --backend-timeout). The end of the output lists every skipped
row and why.

Sections (each case guarded: a failure becomes an `error` row and the rest still run):
  a) Fp8Linear forward + backward (y, dX, dW) through the GEMM executor under test (--executor, else
     $FP8RL_GEMM, else the best one here: torch's blockwise scaled_mm on Hopper) against the CPU-faithful
     emulation run on the same device (`max rel diff` = max over y, dX, dW of max|a - b| / max|b|) and
     against BF16 nn.Linear (`x baseline` = time / BF16 time; TFLOP/s = 3 GEMMs of 2*M*N*K) at
     M = K = N in --sizes (4096 and 1024 on a GPU).
  b) one GRPO step of the `tiny` preset per recipe through fp8rl_core's native engines (benchmarks/
     engine_step.py's worker, in this process): median step time over --steps after one warm-up step,
     and token_mult_prob_error; `x baseline` = step time / bf16's. The warm start is trained briefly
     (--warmstart-steps) into a temporary cache.
  c) the same step with engines.generation=vllm (recipes bf16, fp8_gen) and engines.training=megatron
     (bf16, fp8_e2e), each in a subprocess with a timeout, only where the packages are installed and
     CUDA is there; otherwise one row says why ("not installed" / "needs CUDA").
Prints a Markdown table at the end; --out also writes it as JSON. Without CUDA (and no --allow-cpu) it
says so and exits 0 having run nothing heavy. Exit status 0 unless --strict and a row is an error.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from argparse import Namespace
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import engine_step  # noqa: E402  (benchmarks/engine_step.py: the GRPO-step worker)
import torch  # noqa: E402
from fp8_numerics import timeit  # noqa: E402  (best-of-N wall time, CUDA-synchronised)
from torch import nn  # noqa: E402

COLUMNS = ("section", "case", "status", "time_ms", "ratio", "tflops", "max_rel_diff", "tmpe", "note")
DEFAULT_DEADLINE_S = 480.0
DEFAULT_BUDGETS = {"a": 90.0, "b": 150.0, "c": 240.0}
MIN_START_S = 5.0  # a case needs at least this much time left (in its section and overall) to start


class Clock:
    """The overall deadline and the per-section budgets (seconds from construction / from a section's start)."""

    def __init__(self, deadline_s: float, budgets: dict[str, float], now: Callable[[], float] = time.monotonic):
        self.deadline_s, self.budgets, self.now = deadline_s, budgets, now
        self.t0 = now()
        self.section_t0: dict[str, float] = {}

    def left(self) -> float:
        return self.deadline_s - (self.now() - self.t0)

    def section_left(self, section: str) -> float:
        start = self.section_t0.setdefault(section, self.now())
        return self.budgets.get(section, float("inf")) - (self.now() - start)

    def why_not(self, section: str) -> str | None:
        """Why a new case of `section` may not start now, or None."""
        overall, own = self.left(), self.section_left(section)
        if overall < MIN_START_S:
            return f"overall deadline: {max(overall, 0):.0f} s left of {self.deadline_s:.0f} s (--deadline)"
        if own < MIN_START_S:
            return (f"section {section} budget: {max(own, 0):.0f} s left of {self.budgets[section]:.0f} s "
                    f"(--budgets {section}=...)")
        return None

    def timeout(self, section: str, cap: float) -> float:
        """Seconds a subprocess of `section` may run: what is left of both limits, at most cap."""
        return max(min(cap, self.left(), self.section_left(section)), 1.0)


def timed(clock: Clock, section: str, case: str, fn: Callable[[], list[dict]]) -> list[dict]:
    """guarded(fn) if the clock allows a new case of `section`, else one skipped row saying why."""
    why = clock.why_not(section)
    if why:
        return [row(section, case, "skipped", note=f"not started: {why}")]
    return guarded(section, case, fn)


def row(section: str, case: str, status: str = "ok", **fields: Any) -> dict[str, Any]:
    return {"section": section, "case": case, "status": status, **{k: fields.get(k) for k in COLUMNS[3:]}}


def guarded(section: str, case: str, fn: Callable[[], list[dict]]) -> list[dict]:
    """fn()'s rows, or one error row (traceback to stderr) if it raises."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  (a check script reports every failure and goes on)
        traceback.print_exc(file=sys.stderr)
        first = (str(exc).strip().splitlines() or [""])[0][:240]
        return [row(section, case, "error", note=f"{type(exc).__name__}: {first}")]


# ---- a) FP8 GEMMs ----------------------------------------------------------------------------------
@contextlib.contextmanager
def gemm_executor(name: str) -> Iterator[None]:
    """Run the block with $FP8RL_GEMM=name (fp8rl_core.fp8.gemm reads it at every GEMM)."""
    old = os.environ.get("FP8RL_GEMM")
    os.environ["FP8RL_GEMM"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FP8RL_GEMM", None)
        else:
            os.environ["FP8RL_GEMM"] = old


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (normwise: elementwise ratios blow up where b ~ 0)."""
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def linear_rows(n: int, device: torch.device, executor: str, repeats: int) -> list[dict]:
    """BF16 nn.Linear vs Fp8Linear [executor] vs Fp8Linear [emulated], fwd + bwd at M = K = N = n."""
    from fp8rl_core.fp8 import Fp8Linear

    torch.manual_seed(0)
    ref = nn.Linear(n, n, device=device, dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(ref)
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(n, n, device=device, dtype=torch.bfloat16)

    def step(layer: nn.Module) -> torch.Tensor:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        y = layer(x)
        y.backward(dy)
        return y

    def run(layer: nn.Module, name: str | None) -> tuple[float, list[torch.Tensor]]:
        with gemm_executor(name) if name else contextlib.nullcontext():
            y = step(layer)
            outs = [y.detach().float(), x.grad.float(), layer.weight.grad.float()]
            return timeit(lambda: step(layer), repeats, device), outs

    flops, case = 3 * 2 * n**3, f"M=K=N={n}"
    t_ref, bf16 = run(ref, None)
    t_hw, hw = run(fp8, executor)
    t_emu, emu = run(fp8, "emulated")
    diffs = [rel_diff(a, b) for a, b in zip(hw, emu)]
    per = ", ".join(f"{k} {d:.1e}" for k, d in zip(("y", "dX", "dW"), diffs))
    vs_bf16 = ", ".join(f"{k} {rel_diff(a, b):.1e}" for k, a, b in zip(("y", "dX", "dW"), emu, bf16))
    return [row("a", f"nn.Linear bf16 fwd+bwd {case}", time_ms=t_ref * 1e3, ratio=1.0, tflops=flops / t_ref / 1e12,
                note="baseline"),
            row("a", f"Fp8Linear [{executor}] fwd+bwd {case}", time_ms=t_hw * 1e3, ratio=t_hw / t_ref,
                tflops=flops / t_hw / 1e12, max_rel_diff=max(diffs), note=f"vs emulated: {per}"),
            row("a", f"Fp8Linear [emulated] fwd+bwd {case}", time_ms=t_emu * 1e3, ratio=t_emu / t_ref,
                tflops=flops / t_emu / 1e12, note=f"FP8 vs bf16: {vs_bf16}")]


def section_a(args: Namespace, device: torch.device, clock: Clock) -> list[dict]:
    from fp8rl_core.fp8 import select_executor

    executor = args.executor or os.environ.get("FP8RL_GEMM") or select_executor(device)
    rows = []
    if executor == "emulated":  # no hardware executor here: still compare two different code paths
        executor = "emulated_blockwise"
        if device.type == "cuda":
            rows.append(row("a", "hardware FP8 GEMM executor", "skipped",
                            note="none available (select_executor chose 'emulated'): not an SM90 GPU, "
                                 "or this torch lacks blockwise scaled_mm"))
    for n in args.sizes:
        rows += timed(clock, "a", f"Fp8Linear M=K=N={n}", lambda n=n: linear_rows(n, device, executor, args.repeats))
    return rows


# ---- b) and c) GRPO steps --------------------------------------------------------------------------
def step_overrides(args: Namespace, device: torch.device, work: Path) -> list[str]:
    """Run-config overrides shared by every GRPO-step case (engine_step's --set items)."""
    sets = [f"device={device.type}", f"warmstart.steps={args.warmstart_steps}", f"output_dir={work / 'runs'}"]
    if device.type == "cpu":  # the --allow-cpu smoke: tiny batches
        sets += ["warmstart.batch_size=8", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                 "rollout.max_new_tokens=4", "task.val_size=4"]
    return sets + list(args.set)


def step_row(section: str, case: str, result: dict, baseline: float | None) -> dict:
    steps = result["steps"]
    t = statistics.median(s["step"] for s in steps)
    return row(section, case, time_ms=t * 1e3, ratio=t / baseline if baseline else None,
               tmpe=statistics.mean(s["tmpe"] for s in steps),
               note=f"{result['batch']} sequences, median of {len(steps)} steps")


def warm_start(ns: Namespace) -> list[dict]:
    """Train the warm start once (cached in ns.cache_dir) so that no timed case pays for it."""
    t0 = time.perf_counter()
    engine_step.warm_start(ns)
    return [row("b", "warm start (once)", time_ms=(time.perf_counter() - t0) * 1e3, note="not timed elsewhere")]


def section_b(args: Namespace, ns: Namespace, clock: Clock) -> tuple[list[dict], float | None]:
    rows, base = [], None
    for recipe in args.recipes:
        def one(recipe: str = recipe, base: float | None = base) -> list[dict]:
            r = engine_step.worker(ns, recipe)
            return [step_row("b", f"GRPO step tiny [{recipe}] native engines", r, base)]
        got = timed(clock, "b", f"GRPO step tiny [{recipe}] native engines", one)
        if recipe == "bf16" and got[0]["status"] == "ok":
            base, got[0]["ratio"] = got[0]["time_ms"] / 1e3, 1.0
        rows += got
    return rows, base


def worker_subprocess(ns: Namespace, recipe: str, extra: list[str], timeout: float) -> dict:
    """engine_step's worker for `recipe` in a fresh process (vLLM / Megatron keep process-wide state)."""
    cmd = [sys.executable, str(HERE / "engine_step.py"), "--worker", recipe, "--steps", str(ns.steps),
           "--warmup", str(ns.warmup), "--threads", str(ns.threads), "--cache-dir", ns.cache_dir]
    for item in [*ns.set, *extra]:
        cmd += ["--set", item]
    env = {**os.environ, "PYTHONPATH": engine_step._pythonpath()}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or ["(no stderr)"]
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"worker exit {proc.returncode}: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def backend_missing(modules: tuple[str, ...], has_cuda: bool, hint: str) -> str | None:
    """Why a backend row cannot run here, or None (find_spec only: importing vLLM without CUDA may crash)."""
    absent = [m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None
              or importlib.util.find_spec(m) is None]
    if absent:
        return f"not installed: {', '.join(absent)} ({hint})"
    return None if has_cuda else "installed, but needs CUDA"


def section_c(args: Namespace, ns: Namespace, has_cuda: bool, base: float | None, clock: Clock) -> list[dict]:
    backends = [("vLLM generation", ("vllm",), "pip install 'fp8rl[vllm]'", "engines.generation=vllm",
                 ("bf16", "fp8_gen")),
                ("Megatron-Core training", ("megatron.core", "transformer_engine", "fp8rl_core.engines.megatron_train"),
                 "pip install 'fp8rl[megatron]'", "engines.training=megatron", ("bf16", "fp8_e2e"))]
    rows = []
    for label, modules, hint, setting, recipes in backends:
        why = backend_missing(modules, has_cuda, hint)
        if why:
            rows.append(row("c", label, "skipped", note=why))
            continue
        for recipe in recipes:
            case = f"GRPO step tiny [{recipe}] {label}"
            rows += timed(clock, "c", case, lambda r=recipe, c=case, s=setting: [step_row(
                "c", c, worker_subprocess(ns, r, [s], clock.timeout("c", args.backend_timeout)), base)])
    return rows


# ---- report ---------------------------------------------------------------------------------------
def fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def markdown(rows: list[dict]) -> str:
    head = "| section | case | status | time ms | x baseline | TFLOP/s | max rel diff | tmpe | note |"
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['section']} | {r['case']} | {r['status']} | {fmt(r['time_ms'], '.2f')} | "
                     f"{fmt(r['ratio'], '.2f')} | {fmt(r['tflops'], '.3g')} | {fmt(r['max_rel_diff'], '.2e')} | "
                     f"{fmt(r['tmpe'], '.5f')} | {r['note'] or ''} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allow-cpu", action="store_true", help="no CUDA: run a tiny CPU smoke instead of exiting")
    ap.add_argument("--out", type=Path, help="also write the table as JSON here")
    ap.add_argument("--executor", help="GEMM executor under test (default: $FP8RL_GEMM, else the best here)")
    ap.add_argument("--sections", default="a,b,c", help="comma list of a, b, c")
    ap.add_argument("--sizes", help="comma list of M = K = N for section a (GPU: 4096,1024; CPU: 256,128)")
    ap.add_argument("--repeats", type=int, help="timed repeats per GEMM case (GPU 5, CPU 1)")
    ap.add_argument("--recipes", nargs="+", default=["bf16", "fp8_gen", "fp8_e2e"])
    ap.add_argument("--warmstart-steps", type=int, help="supervised warm-start steps (GPU 200, CPU 4)")
    ap.add_argument("--steps", type=int, default=2, help="measured GRPO steps per case (after 1 warm-up)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: min(8, cores); CPU smoke 1)")
    ap.add_argument("--backend-timeout", type=float, default=300.0,
                    help="seconds per vLLM/Megatron case (at most what the deadline and section c's budget leave)")
    ap.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S,
                    help=f"overall seconds; no case starts later (default {DEFAULT_DEADLINE_S:.0f})")
    ap.add_argument("--budgets", default=",".join(f"{k}={v:.0f}" for k, v in DEFAULT_BUDGETS.items()),
                    help="per-section seconds, e.g. a=90,b=150,c=240 (a section may not start a case past its own)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra run-config override")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any row is an error")
    args = ap.parse_args(argv)
    cpu = not torch.cuda.is_available()
    args.sizes = [int(v) for v in args.sizes.split(",")] if args.sizes else ([256, 128] if cpu else [4096, 1024])
    args.repeats = args.repeats or (1 if cpu else 5)
    args.warmstart_steps = 4 if cpu and args.warmstart_steps is None else (args.warmstart_steps or 200)
    args.threads = args.threads or (1 if cpu else min(8, os.cpu_count() or 1))
    args.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    args.budgets = parse_budgets(args.budgets)
    return args


def parse_budgets(text: str) -> dict[str, float]:
    """'a=90,b=150' -> {"a": 90.0, "b": 150.0, "c": DEFAULT}; sections not named keep their default."""
    out = dict(DEFAULT_BUDGETS)
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, _, value = item.partition("=")
        if key not in DEFAULT_BUDGETS or not value:
            raise SystemExit(f"--budgets: {item!r}; expected section=seconds with section in a, b, c")
        out[key] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    has_cuda = torch.cuda.is_available()
    report: dict[str, Any] = {"torch": torch.__version__, "cuda": has_cuda, "rows": []}
    if not has_cuda and not args.allow_cpu:
        print("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing was run. "
              "Run it on a GPU machine, or with --allow-cpu for a tiny CPU smoke of the same code paths.")
        print(f"skipped: sections {', '.join(sorted(args.sections))}: no CUDA GPU (torch {torch.__version__})")
        report["skipped"] = "no CUDA"
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    device = torch.device("cuda" if has_cuda else "cpu")
    report["device"] = (torch.cuda.get_device_name(device) if has_cuda
                        else f"cpu ({torch.get_num_threads()} threads)")
    print(f"# gpu_check: torch {torch.__version__}, {report['device']}, sections {sorted(args.sections)}", flush=True)
    t0, rows = time.perf_counter(), []
    clock = Clock(args.deadline, args.budgets)
    print(f"# deadline {args.deadline:.0f} s; budgets " + ", ".join(f"{k} {v:.0f} s" for k, v in args.budgets.items()),
          flush=True)
    with tempfile.TemporaryDirectory(prefix="fp8rl-gpu-check-") as tmp:
        work = Path(tmp)
        ns = Namespace(threads=args.threads, cache_dir=str(work / "warmstart"), warmup=1, steps=args.steps,
                       set=step_overrides(args, device, work))
        if "a" in args.sections:
            rows += section_a(args, device, clock)
            print(f"# section a done at {time.perf_counter() - t0:.0f}s", flush=True)
        base = None
        if args.sections & {"b", "c"}:
            rows += timed(clock, "b", "warm start", lambda: warm_start(ns))
        if "b" in args.sections:
            got, base = section_b(args, ns, clock)
            rows += got
            print(f"# section b done at {time.perf_counter() - t0:.0f}s", flush=True)
        if "c" in args.sections:
            rows += section_c(args, ns, has_cuda, base, clock)
    skipped_sections = sorted({"a", "b", "c"} - args.sections)
    report.update(rows=rows, elapsed_s=time.perf_counter() - t0, deadline_s=args.deadline, budgets=args.budgets,
                  sections_not_selected=skipped_sections)
    print(markdown(rows))
    print(f"\ntotal {report['elapsed_s']:.0f}s (deadline {args.deadline:.0f}s)")
    skipped = [r for r in rows if r["status"] == "skipped"]
    if skipped or skipped_sections:
        print("skipped:")
        for name in skipped_sections:
            print(f"- section {name}: not selected (--sections)")
        for r in skipped:
            print(f"- [{r['section']}] {r['case']}: {r['note']}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if args.strict and any(r["status"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
