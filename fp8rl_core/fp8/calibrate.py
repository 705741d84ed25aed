"""The CPU's FP8 GEMM executor chosen by measurement: a calibration of <= 2 s, kept on disk per machine.

    decision = calibrate()        # Calibration(executor, default, timings_s, key, cached)
    choose({"emulated": 0.012, "cpu_bf16dot": 0.008}, default="emulated")   # -> "cpu_bf16dot"

The executors agree within the FP8 GEMM bound (gemm_bound.py) but not bit for bit (summation order), so the
choice is made once (per sweep: choice.py; per run outside one) and never by chance:
  1. candidates: the CPU executors this machine runs (emulated, emulated_blockwise, and cpu_bf16dot where
     cpu_gemm.path() finds AMX or AVX512_BF16);
  2. each runs forward + backward (fprop, dgrad, wgrad: the three GEMMs of a blockwise Fp8Linear, its weight
     re-quantized as after an optimizer step) on SHAPES, a fixed representative set (M = 256 tokens, a square
     512 -> 512 and a 512 -> 1536 MLP-like projection: the run's own model is not known yet when the
     executor is pinned, before the warm start), the candidates taking turns, best of the rounds that fit
     BUDGET_S;
  3. `choose`: the fastest wins only by MARGIN over the default (gemm.default_executor, the static rule:
     cpu_bf16dot where AMX, else emulated): a speed-up of >= 1.15x; anything closer keeps the default, so
     noise never flips it.
The result is cached in $FP8RL_EXECUTOR_CACHE (default ~/.cache/fp8rl/executor) as `<key>.json` under an
fcntl lock (concurrent cells wait for one calibration); the key hashes the CPU model name, its flags (less
$FP8RL_CPU_FLAGS_OFF), the kernels' sources (cpu_gemm.c, fused_cpu.c, fp8rl_kernels.h), torch's version, the
thread count, SHAPES, MARGIN and VERSION. A cache file that does not parse or does not match its key is
recalibrated with a warning. $FP8RL_GEMM_CALIBRATE=0 skips the measurement (the default, nothing cached): the
test suite sets it, so that no test's numbers depend on the machine's speed. BF16 native vs emulated is never
chosen here (they differ in summation order; model/bf16.py: the BF16 path is resolved once per run, not timed).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fp8rl_core.fp8 import cbuild, cpu_features, gemm

ENV_CACHE = "FP8RL_EXECUTOR_CACHE"
ENV_CALIBRATE = "FP8RL_GEMM_CALIBRATE"  # "0": no measurement, the default
VERSION = 1  # bump when the measurement changes meaning
MARGIN = 0.15  # the fastest must be >= 1.15x the default's speed to replace it
BUDGET_S = 2.0  # the whole calibration, warm-up included (at least one timed round runs)
SHAPES = ((256, 512, 512), (256, 512, 1536))  # (M tokens, K in_features, N out_features) of an Fp8Linear
KERNEL_SOURCES = ("cpu_gemm.c", "fused_cpu.c", "fp8rl_kernels.h")

Timings = dict[str, float]  # executor -> seconds of one forward + backward over SHAPES (best round)


@dataclass(frozen=True)
class Calibration:
    executor: str  # the choice
    default: str  # what the static rule picks (gemm.default_executor)
    timings_s: Timings
    key: str  # cache_key() it was measured under
    cached: bool = False  # read from the disk cache (not measured by this process)

    def describe(self) -> str:
        """'emulated 12.1 ms, emulated_blockwise 30.2 ms (default emulated, margin 15%)'."""
        if not self.timings_s:
            return f"not measured, ${ENV_CALIBRATE}=0"
        times = ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in sorted(self.timings_s.items(), key=lambda kv: kv[1]))
        return f"{times} (default {self.default}, margin {MARGIN:.0%})"


def choose(timings: Timings, default: str, margin: float = MARGIN) -> str:
    """The executor to run: the fastest of `timings` if it beats `default` by a speed-up of at least
    1 + margin, else `default` (also when the default was not measured: nothing to beat it by)."""
    if default not in timings or not timings:
        return default
    best = min(timings, key=lambda name: (timings[name], name != default))
    return best if timings[default] >= (1 + margin) * timings[best] else default


def candidates() -> list[str]:
    """The CPU executors this machine runs, the default first."""
    from fp8rl_core.fp8 import cpu_gemm

    names = ["emulated", "emulated_blockwise"] + (["cpu_bf16dot"] if cpu_gemm.path() is not None else [])
    default = gemm.default_executor("cpu")
    return [default, *(n for n in names if n != default)]


def kernel_version() -> str:
    """sha256[:16] of the C kernels' sources and header: a kernel change recalibrates."""
    here = Path(__file__).parent
    return hashlib.sha256(b"\0".join((here / f).read_bytes() for f in KERNEL_SOURCES)).hexdigest()[:16]


def cpu_model() -> str:
    for line in cbuild.cpu_id().splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return os.uname().machine


def cache_key() -> str:
    """What a calibration's result depends on, hashed (see the module docstring)."""
    parts = [f"v{VERSION}", cpu_model(), " ".join(sorted(cpu_features.cpu_flags())), kernel_version(),
             torch.__version__, f"threads={torch.get_num_threads()}", repr(SHAPES), f"margin={MARGIN}"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "fp8rl" / "executor")


def _step(executor: str, m: int, k: int, n: int) -> Callable[[], None]:
    """One Fp8Linear forward + backward on `executor` (the weight re-quantized first, as after an update)."""
    from fp8rl_core.fp8.linear import Fp8Linear

    g = torch.Generator().manual_seed(m + k + n)
    layer = Fp8Linear(k, n)
    x = torch.randn(m, k, generator=g).requires_grad_()
    dy = torch.randn(m, n, generator=g)

    def step() -> None:
        with gemm.trying(executor):
            x.grad = None
            layer.zero_grad(set_to_none=True)
            layer.invalidate()
            layer(x).backward(dy)

    return step


def measure(executors: list[str], shapes: tuple[tuple[int, int, int], ...] = SHAPES,
            budget_s: float = BUDGET_S) -> Timings:
    """Seconds of one forward + backward over `shapes` per executor: one warm-up call each, then rounds in
    which every executor takes its turn (a change of load reaches all alike), best round kept, until the
    budget is spent (at least one round). An executor that raises is left out, with a warning."""
    start, steps = time.perf_counter(), {}
    for name in executors:
        try:
            fns = [_step(name, *shape) for shape in shapes]
            for fn in fns:
                fn()
            steps[name] = fns
        except Exception as e:  # noqa: BLE001 - an executor that cannot run here is no candidate
            warnings.warn(f"fp8rl: FP8 GEMM calibration: {name} failed ({e}); not a candidate", stacklevel=2)
    best = {name: float("inf") for name in steps}
    rounds = 0
    while rounds == 0 or time.perf_counter() - start < budget_s * (rounds / (rounds + 1)):
        for name, fns in steps.items():
            t0 = time.perf_counter()
            for fn in fns:
                fn()
            best[name] = min(best[name], time.perf_counter() - t0)
        rounds += 1
        if rounds >= 20:
            break
    return best


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive fcntl lock on `path`.lock for the block (other processes, and other opens here, wait)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def write_json(path: Path, data: dict) -> None:
    """Atomically (a temporary file renamed over it): a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _read(path: Path, key: str) -> Calibration | None:
    """The cached calibration, None when absent; a file that does not parse or match: a warning, None."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        cal = Calibration(executor=data["executor"], default=data["default"],
                          timings_s={str(n): float(t) for n, t in data["timings_s"].items()}, key=data["key"],
                          cached=True)
        if cal.key != key or cal.executor not in gemm.EXECUTORS or cal.default not in gemm.EXECUTORS:
            raise ValueError(f"key {cal.key!r} / executor {cal.executor!r} do not fit key {key!r}")
        return cal
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        warnings.warn(f"fp8rl: FP8 GEMM calibration cache {path} is unreadable ({type(e).__name__}: {e}); "
                      f"calibrating again", stacklevel=3)
        return None


def calibrate(measure_fn: Callable[[list[str]], Timings] = measure, folder: Path | None = None) -> Calibration:
    """This machine's CPU executor: the cached calibration, else a new one (measured under the cache's lock,
    so that concurrent cells measure once and the others read it)."""
    key = cache_key()
    if os.environ.get(ENV_CALIBRATE, "1") in ("0", "false", "off"):
        default = gemm.default_executor("cpu")
        return Calibration(default, default, {}, key)
    path = (folder or cache_dir()) / f"{key}.json"
    with locked(path):
        found = _read(path, key)
        if found is not None:
            return found
        names = candidates()
        timings = measure_fn(names)
        cal = Calibration(choose(timings, names[0]), names[0], timings, key)
        write_json(path, {k: v for k, v in asdict(cal).items() if k != "cached"})
    return cal


def read_cached(folder: Path | None = None) -> Calibration | None:
    """The cached calibration of this machine, without measuring (None if there is none): for log lines."""
    path = (folder or cache_dir()) / f"{cache_key()}.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _read(path, cache_key()) if path.exists() else None
