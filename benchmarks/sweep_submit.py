"""Benchmark: submitting 200 cells to the local SLURM cluster (issue 5's goal: one sbatch, one array).

    bash scripts/slurm/cluster.sh up && python benchmarks/sweep_submit.py [--cells 200] [--no-wait]

Rows, measured in one run against the same cluster:
1. ours: `launchers.executors.slurm.SlurmExecutor.submit` of 200 tasks (a trivial function): wall
   time of the submission and number of sbatch calls (counted at the subprocess boundary); then the
   time until every task has completed (2 at a time: the array's %max_parallel, on 2 cores) with
   one sacct per poll for all 200, plus one squeue only when sacct lags (both counted).
2. the full driver: `sweep run --detach` of a 200-cell grid (SQLite MLflow store: experiment, parent
   run and 200 SCHEDULED child runs, then the one array and the report stage), cancelled afterwards.
3. baseline: submitit without batching, one `executor.submit` per cell (what a loop over cells does,
   as in Hydra's submitit launcher): 200 sbatch calls; cancelled at once.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cloudpickle  # noqa: E402

from launchers.executors import Task, is_alive  # noqa: E402
from launchers.executors.slurm import SlurmExecutor  # noqa: E402
from launchers.executors.slurm.sbatch import SlurmSubmission  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
CALLS: dict[str, int] = {}


def trivial(i: int) -> int:
    return i * i


@contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Count the processes started (by program name): every scheduler command goes through Popen
    (submitit's sbatch, our sacct/scancel via subprocess.run)."""
    CALLS.clear()
    real = subprocess.Popen

    class Counted(real):  # type: ignore[misc, valid-type]
        def __init__(self, args, *a, **k):
            name = Path(str(args[0] if isinstance(args, (list, tuple)) else args).split()[0]).name
            CALLS[name] = CALLS.get(name, 0) + 1
            super().__init__(args, *a, **k)

    subprocess.Popen = Counted
    try:
        yield CALLS
    finally:
        subprocess.Popen = real


def params() -> dict:
    return {"job_name": "bench", "time": 10, "array_parallelism": 2, "cpus_per_task": 1, "mem": "500M"}


def ours(folder: Path, n: int, wait: bool) -> dict:
    ex = SlurmExecutor(SlurmSubmission(folder / "jobs" / "%j", sys.executable, params()))
    with counting() as calls:
        t0 = time.perf_counter()
        handles = ex.submit([Task(f"c{i}", trivial, (i,)) for i in range(n)])
        submit_s = time.perf_counter() - t0
        sbatch = calls.get("sbatch", 0)
    row = {"what": f"ours: one batch of {n}", "submit_s": submit_s, "sbatch": sbatch, "arrays": len(
        {h.job_id.split("_")[0] for h in handles})}
    if wait:
        with counting() as calls:
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                states = ex.poll(handles)
                # "unknown": ended but not yet in accounting (sacct lags); wait for its final state
                if not any(is_alive(s) or s == "unknown" for s in states.values()):
                    break
                time.sleep(2.0)
            row.update(done_s=time.perf_counter() - t0, sacct=calls.get("sacct", 0), squeue=calls.get("squeue", 0),
                       completed=sum(s == "done" for s in states.values()))
    else:
        ex.cancel(handles)
    return row


def full_driver(folder: Path, n: int) -> dict:
    import io

    from launchers.run.cancel import cancel_sweep
    from launchers.run.driver import run_sweep
    from launchers.sweepfile.loading import load_sweep

    seeds = list(range(n))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bench.yaml"
    path.write_text("experiment: bench_driver\nbase: {warmstart: {steps: 0}, train: {steps: 1}}\n"
                    f"grid: {{seed: {seeds}}}\nlauncher: {{kind: slurm, max_parallel: 2, slurm: {{time: 10}}}}\n"
                    f"tracking: {{uri: 'sqlite:///{folder}/mlflow.db'}}\n")
    sweep = load_sweep(path, cwd=folder)
    from fp8rl_core.tracking.store import Store

    Store(sweep.tracking_uri()).create_tables()  # the store's schema, outside the timing
    with counting() as calls:
        t0 = time.perf_counter()
        rc = run_sweep(sweep, detach=True, out=io.StringIO(), report=False)
        total = time.perf_counter() - t0
        sbatch = calls.get("sbatch", 0)
    cancel_sweep(sweep, io.StringIO())
    return {"what": f"sweep run --detach, {n} cells", "submit_s": total, "sbatch": sbatch, "arrays": 1, "rc": rc}


def baseline(folder: Path, n: int) -> dict:
    import submitit

    ex = submitit.SlurmExecutor(folder=folder / "base" / "%j", python=sys.executable)
    ex.update_parameters(**{k: v for k, v in params().items() if k != "array_parallelism"})
    with counting() as calls:
        t0 = time.perf_counter()
        jobs = [ex.submit(trivial, i) for i in range(n)]
        submit_s = time.perf_counter() - t0
        sbatch = calls.get("sbatch", 0)
    subprocess.run(["scancel", *[j.job_id for j in jobs]], check=False)
    return {"what": f"baseline: {n} x submit", "submit_s": submit_s, "sbatch": sbatch, "arrays": 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=200)
    ap.add_argument("--no-wait", action="store_true", help="do not run the 200 tasks to completion")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=Path.cwd()) as tmp:  # on a disk the jobs see
        folder = Path(tmp)
        rows = [ours(folder / "ours", args.cells, not args.no_wait), full_driver(folder / "driver", args.cells),
                baseline(folder / "baseline", args.cells)]
    print(f"\n{'what':32} {'submit s':>9} {'sbatch calls':>13} {'arrays':>7} {'all done s':>11} "
          f"{'sacct calls':>12} {'squeue calls':>13}")
    for r in rows:
        print(f"{r['what']:32} {r['submit_s']:9.2f} {r['sbatch']:13d} {r['arrays']:7d} "
              f"{r.get('done_s', float('nan')):11.1f} {r.get('sacct', 0):12d} {r.get('squeue', 0):13d}")
    base, us = rows[2], rows[0]
    print(f"\nsubmission: ours {us['submit_s']:.2f} s / baseline {base['submit_s']:.2f} s = "
          f"{us['submit_s'] / base['submit_s']:.3f}x; sbatch calls {us['sbatch']} vs {base['sbatch']}"
          + (f"; {us['completed']}/{args.cells} tasks completed" if "completed" in us else ""))


if __name__ == "__main__":
    main()
