"""A synthetic sweep with known means, for tests, the UI screenshot script and trying the report.

    runs = synthetic_runs(seeds=3, steps=30)                  # list[RunHistory], in memory
    parent = log_sweep("sqlite:///demo.db", "fp8rl", "demo", runs)   # the same runs in MLflow

Values: per run, `token_mult_prob_error = 1 + (mismatch[recipe] − 1) · exp(seed offset (sd 0.15) +
step noise (sd 0.08))` (>= 1, as the real metric); `val_accuracy` every `val_every` steps rises linearly from `acc0` to `final_acc[(recipe,
IS)]` + seed offset (sd 0.015). No claim about real FP8 runs is made by these numbers.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from analysis.fetch import RunHistory

MISMATCH = {"bf16": 1.004, "fp8_gen": 1.06, "fp8_e2e": 1.02}
FINAL_ACC = {("bf16", "none"): 0.70, ("bf16", "token"): 0.70, ("fp8_gen", "none"): 0.52,
             ("fp8_gen", "token"): 0.66, ("fp8_e2e", "none"): 0.63, ("fp8_e2e", "token"): 0.69}
STEP_TIME = {"bf16": 1.0, "fp8_gen": 1.25, "fp8_e2e": 1.4}


def synthetic_runs(recipes: Sequence[str] = ("bf16", "fp8_gen", "fp8_e2e"), is_variants: Sequence[str] = ("none", "token"),
                   seeds: int = 3, steps: int = 21, val_every: int = 5, mismatch: Mapping[str, float] = MISMATCH,
                   final_acc: Mapping[tuple[str, str], float] = FINAL_ACC, acc0: float = 0.3,
                   seed_sd: float = 0.015, rng_seed: int = 0) -> list[RunHistory]:
    """One RunHistory per (recipe, IS, seed); its `metrics` are the exact values a test compares to."""
    rng = np.random.default_rng(rng_seed)
    runs = []
    all_steps = np.arange(steps, dtype=np.int64)
    val_steps = np.unique(np.r_[np.arange(0, steps, val_every), steps - 1]).astype(np.int64)
    for recipe in recipes:
        for isv in is_variants:
            for seed in range(seeds):
                excess = mismatch.get(recipe, 1.03) - 1.0  # the metric is >= 1 by definition: noise it multiplicatively
                mm = 1.0 + excess * np.exp(rng.normal(0, 0.15) + rng.normal(0, 0.08, steps))
                target = final_acc.get((recipe, isv), 0.6) + rng.normal(0, seed_sd)
                acc = acc0 + (target - acc0) * val_steps / max(steps - 1, 1) + rng.normal(0, 0.004, val_steps.size)
                acc[-1] = target
                step_time = STEP_TIME.get(recipe, 1.0) * (1 + rng.normal(0, 0.02, steps))
                metrics = {
                    "token_mult_prob_error": (all_steps, mm),
                    "val_accuracy": (val_steps, acc),
                    "reward_mean": (all_steps, np.interp(all_steps, val_steps, acc) + rng.normal(0, 0.02, steps)),
                    "is_weight_mean": (all_steps, 1 + rng.normal(0, 0.01, steps) * (isv != "none")),
                    "loss": (all_steps, 0.5 * np.exp(-all_steps / steps) + rng.normal(0, 0.01, steps)),
                    "step_time_s": (all_steps, step_time),
                    "tokens_per_s": (all_steps, 1024 / step_time),
                }
                tags = {"recipe": recipe, "importance_sampling": isv, "seed": str(seed),
                        "cell_id": f"{recipe}-{isv}-{seed}"}
                params = {"recipe": recipe, "loss.importance_sampling": isv, "seed": str(seed)}
                runs.append(RunHistory("", f"{recipe}-{isv}-s{seed}", "FINISHED", tags, params, metrics))
    return runs


def log_sweep(uri: str, experiment: str, sweep_name: str, runs: Sequence[RunHistory],
              config_dir: str | Path | None = None) -> str:
    """Write `runs` as a sweep (parent + child runs, through `fp8rl_core.tracking.runs`); sets each
    run's `run_id`; returns the parent run id. Metrics go in `log_batch` calls of <= 1000."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from fp8rl_core.tracking import runs as tr

    exp_id = tr.ensure_experiment(uri, experiment)
    parent = tr.create_parent_run(uri, experiment, sweep_name, params={"seeds": len({r.tags["seed"] for r in runs})},
                                  config={"experiment": experiment, "name": sweep_name})
    client = MlflowClient(uri)
    for run in runs:
        tags = {k: v for k, v in run.tags.items() if k != "cell_id"}
        run.run_id, _ = tr.find_or_create_cell_run(uri, exp_id, parent, run.tags["cell_id"], tags=tags,
                                                   params=run.params, config=run.params, run_name=run.run_name)
        metrics = [Metric(k, float(v), 1_700_000_000_000 + int(s), int(s))
                   for k, (steps, values) in run.metrics.items() for s, v in zip(steps, values)]
        for i in range(0, len(metrics), 1000):
            client.log_batch(run.run_id, metrics=metrics[i : i + 1000], synchronous=True)
        client.set_terminated(run.run_id, run.status)
    return parent
