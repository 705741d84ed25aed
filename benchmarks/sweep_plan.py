"""Benchmark: `sweep plan` of a 10,000-cell grid (issue 5's goal: < 2 s).

    python benchmarks/sweep_plan.py [--cells-per-key 10]

Writes a 4-key x 10-value grid (seed, optim.lr, loss.is_cap, rollout.temperature) to a temp file and
times, in this process: load + validate, expansion (10,000 resolved RunConfigs and ids), and the
whole `sweep plan --all` (table of every cell printed to a buffer); then the command as a user runs
it (`python -m launchers.cli plan FILE --all` in a fresh interpreter, imports included). Baseline, measured in the same
run: building each cell's RunConfig from a dict with fp8rl_core.config.run_config_from_dict and
hashing it with run_config_hash (the obvious implementation), on a sample of the cells, scaled.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8rl_core.config import apply_overrides, run_config_from_dict, run_config_hash  # noqa: E402
from launchers import cli  # noqa: E402
from launchers.plan.grid import expand_grid  # noqa: E402
from launchers.sweepfile.loading import load_sweep  # noqa: E402

GOAL_S = 2.0


def sweep_text(n: int) -> str:
    lrs = ", ".join(f"{1e-5 * (i + 1):.6g}" for i in range(n))
    caps = ", ".join(f"{1.5 + 0.5 * i}" for i in range(n))
    temps = ", ".join(f"{0.5 + 0.05 * i:.4g}" for i in range(n))
    return (f"experiment: bench\nbase:\n  train: {{steps: 3}}\ngrid:\n  seed: {list(range(n))}\n"
            f"  optim.lr: [{lrs}]\n  loss.is_cap: [{caps}]\n  rollout.temperature: [{temps}]\n")


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells-per-key", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.yaml"
        path.write_text(sweep_text(args.cells_per_key))
        sweep = load_sweep(path, cwd=Path(tmp))
        cells = expand_grid(sweep).cells
        n = len(cells)

        def plan() -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                assert cli.main(["plan", str(path), "--all"]) == 0

        t_load = best_of(lambda: load_sweep(path, cwd=Path(tmp)), args.repeat)
        t_expand = best_of(lambda: expand_grid(sweep), args.repeat)
        t_plan = best_of(plan, args.repeat)
        cmd = [sys.executable, "-m", "launchers.cli", "plan", str(path), "--all"]
        root = Path(__file__).resolve().parents[1]
        t_cmd = best_of(lambda: subprocess.run(cmd, cwd=root, check=True, stdout=subprocess.DEVNULL), args.repeat)

        sample = cells[:: max(1, n // 500)]
        def naive() -> None:
            for c in sample:
                run_config_hash(run_config_from_dict(apply_overrides(
                    sweep.base_data, [f"{k}={v!r}" for k, v in c.params.items()])))
        t_naive = best_of(naive, 1) * n / len(sample)

    rows = [("load + validate", t_load), ("expand (cells + ids)", t_expand),
            ("sweep plan --all (in process)", t_plan), ("sweep plan --all (fresh process)", t_cmd),
            ("baseline: build + hash each cell", t_naive)]
    print(f"sweep plan benchmark: {n} cells, best of {args.repeat}")
    print(f"{'stage':34s} {'seconds':>8s} {'us/cell':>8s}")
    for name, t in rows:
        print(f"{name:34s} {t:8.3f} {1e6 * t / n:8.1f}")
    print(f"plan (fresh process) vs goal ({GOAL_S:.0f} s): {t_cmd / GOAL_S:.2f}x of the budget "
          f"({'met' if t_cmd < GOAL_S else 'MISSED'}); expansion is {t_naive / t_expand:.1f}x faster "
          f"than the baseline")


if __name__ == "__main__":
    main()
