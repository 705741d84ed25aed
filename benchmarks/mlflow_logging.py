"""Benchmark: MLflow metric logging, `log_batch` vs `log_metric`, and 4 processes on one SQLite file.

    python benchmarks/mlflow_logging.py [--metrics 1000] [--http] [--procs 4 --steps 200]

1. One process logs N metrics into a fresh `sqlite:///` store, once as N `log_metric` calls and once as
   `log_batch` calls of <= 1000 (the baseline is log_metric; the ratio is the speed-up). With --http,
   the same through a `mlflow server` on 127.0.0.1 (started here; ~20-60 s).
2. `--procs` processes each log `--steps` steps x 6 metrics into their own run of ONE SQLite file at the
   same time, two ways: (a) raw `log_batch` per step with no retry (counts "database is locked"
   failures = lost steps), (b) through `MlflowSink` with a flush every step (retries with backoff);
   then counts what landed and any duplicate steps.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlflow.entities import Metric

from fp8rl_core.tracking import CONTRACT_METRICS, FINISHED
from fp8rl_core.tracking.store import Store

KEYS = CONTRACT_METRICS[:6]  # the contract's per-step metrics: six values a step


def _fresh_run(uri: str, name: str) -> str:
    client = Store(uri)
    exp_id = client.experiment_id(name) or client.create_experiment(name)
    return client.create_run(exp_id).info.run_id


def time_single(uri: str, n: int) -> tuple[float, float]:
    client = Store(uri)
    run_a, run_b = _fresh_run(uri, "bench-a"), _fresh_run(uri, "bench-b")
    ts = int(time.time() * 1000)
    t0 = time.perf_counter()
    for i in range(n):
        client.log_metric(run_a, KEYS[i % 6], float(i), ts, i // 6, synchronous=True)
    t_metric = time.perf_counter() - t0
    metrics = [Metric(KEYS[i % 6], float(i), ts, i // 6) for i in range(n)]
    t0 = time.perf_counter()
    for i in range(0, n, 1000):
        client.log_batch(run_b, metrics=metrics[i : i + 1000], synchronous=True)
    return t_metric, time.perf_counter() - t0


WORKER = rf"""
import json, sys, time
from mlflow.entities import Metric
from fp8rl_core.tracking.store import Store
mode, uri, run_id, buf, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
keys = {KEYS!r}
t0 = time.perf_counter(); lost = 0; failures = 0
if mode == "raw":
    client = Store(uri)
    for s in range(steps):
        try:
            client.log_batch(run_id, metrics=[Metric(k, s + i / 10, int(time.time() * 1000), s)
                                              for i, k in enumerate(keys)], synchronous=True)
        except Exception as e:
            lost += 1
else:
    from fp8rl_core.tracking.mlflow_sink import MlflowSink
    sink = MlflowSink(uri, run_id, buf, background=False, initial_backoff_s=0.05, max_backoff_s=2.0)
    for s in range(steps):
        sink.log(s, {{k: s + i / 10 for i, k in enumerate(keys)}})
        sink.flush()
    ok = sink.close({FINISHED!r})
    failures = sink.failures; lost = 0 if ok else -1
print(json.dumps({{"wall_s": time.perf_counter() - t0, "lost_steps": lost, "retries": failures}}))
"""


def concurrent(uri: str, procs: int, steps: int, mode: str, tmp: Path) -> dict:
    run_ids = [_fresh_run(uri, f"conc-{mode}") for _ in range(procs)]
    t0 = time.perf_counter()
    ps = [subprocess.Popen([sys.executable, "-c", WORKER, mode, uri, r, str(tmp / f"{mode}{i}.jsonl"), str(steps)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i, r in enumerate(run_ids)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in ps]
    wall = time.perf_counter() - t0
    client = Store(uri)
    landed = dups = 0
    for r in run_ids:
        for k in KEYS:
            steps_seen = [m.step for m in client.get_metric_history(r, k)]
            landed += len(set(steps_seen))
            dups += len(steps_seen) - len(set(steps_seen))
    return {"mode": mode, "wall_s": wall, "expected": procs * steps * len(KEYS), "landed": landed, "duplicates": dups,
            "lost_steps": sum(o["lost_steps"] for o in outs), "retries": sum(o["retries"] for o in outs),
            "worker_s": max(o["wall_s"] for o in outs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", type=int, default=1000)
    ap.add_argument("--http", action="store_true")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        uri = f"sqlite:///{tmp / 'mlflow.db'}"
        Store(uri).create_tables()  # create the tables before timing
        rows = [("sqlite", *time_single(uri, args.metrics))]
        if args.http:
            from fp8rl_core.tracking.server import start_server

            with start_server(f"sqlite:///{tmp / 'http.db'}", log_path=tmp / "server.log") as server:
                rows.append(("http", *time_single(server.url, args.metrics)))
        print(f"\n{args.metrics} metrics, one process")
        print(f"{'store':8} {'log_metric s':>13} {'per call ms':>12} {'log_batch s':>12} {'speed-up':>9}")
        for store, tm, tb in rows:
            print(f"{store:8} {tm:13.3f} {1000 * tm / args.metrics:12.2f} {tb:12.3f} {tm / tb:8.1f}x")
        print(f"\n{args.procs} processes x {args.steps} steps x {len(KEYS)} metrics into one SQLite file")
        print(f"{'mode':6} {'wall s':>7} {'expected':>9} {'landed':>7} {'dups':>5} {'lost steps':>11} {'retries':>8}")
        for mode in ("raw", "sink"):
            r = concurrent(uri, args.procs, args.steps, mode, tmp)
            print(f"{r['mode']:6} {r['wall_s']:7.1f} {r['expected']:9d} {r['landed']:7d} {r['duplicates']:5d} "
                  f"{r['lost_steps']:11d} {r['retries']:8d}")


if __name__ == "__main__":
    main()
