"""A synthetic sweep with known means, for tests, the UI screenshot script and trying the report.

    runs = synthetic_runs(seeds=3, steps=30)                  # list[RunHistory], in memory
    parent = log_sweep("sqlite:///demo.db", "fp8rl", "demo", runs)   # the same runs in MLflow

Values: per run, `token_mult_prob_error = 1 + (mismatch[recipe] − 1) · exp(seed offset (sd 0.15) +
step noise (sd 0.08))` (>= 1, as the real metric); `val_accuracy` every `val_every` steps rises
linearly from `acc0` to `final_acc[(recipe, IS)]` + seed offset (sd 0.015). Options with known
effects for the claim tests:
- `shared_sd`: a per-seed accuracy offset common to every cell of that seed (the seed's prompts), so
  paired differences cancel it and unpaired comparisons do not;
- `spikes`: `{(recipe, IS, seed): value}` sets 3 steps of that run's mismatch to `value` (the
  heavy-tailed spikes of real runs);
- `tails`: also log `logprob_abs_diff_frac_gt_{0.1,1,10}` per step;
- `matched`: recipes that also get matched-kernel runs (param `engines.kernels: matched`, IS none,
  the same seeds, cell id `<recipe>-none-<seed>-matched`), mismatch `matched_mismatch[recipe]`:
  exactly 1.0 at every step for bf16 and fp8_e2e (the trainer replays the generation engine),
  1 + noise for fp8_gen (FP8 generation, BF16 training: a precision gap is left);
- `bf16_eval`: also log `val_accuracy_bf16_eval` at the validation steps: `val_accuracy −
  eval_offset[recipe]` (+ noise, sd 0.003), exactly `val_accuracy` for bf16 (its own engine is BF16),
  so the step-0 offset val_accuracy − val_accuracy_bf16_eval is `eval_offset[recipe]` + noise.
Distinct runs carry the param `engines.kernels: distinct` as a current run does (older runs lack it).
The extra draws (matched runs, bf16_eval noise) come from their own random streams, so a sweep's
other values do not depend on whether they are asked for.
`constant_runs` builds small sweeps with constant histories (exact per-run summaries; optionally
`val_accuracy_bf16_eval` too);
`simulate_cells` draws per-run summaries for thousands of sweeps at once (numpy), for the error-rate
and power tests of the claims' decision rules. No claim about real FP8 runs is made by these numbers.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from analysis.fetch import RunHistory
from analysis.kernel_match import DISTINCT, KERNELS_PARAM, MATCHED
from analysis.summaries import FRAC_METRICS
from fp8rl_core.tracking import (
    FINISHED,
    M_IS_WEIGHT,
    M_LOSS,
    M_MISMATCH,
    M_REWARD,
    M_STEP_TIME,
    M_TOKENS_PER_S,
    M_VAL_ACC,
    M_VAL_ACC_BF16_EVAL,
    TAG_CELL_ID,
    TAG_IS,
    TAG_RECIPE,
    TAG_SEED,
)
from fp8rl_core.tracking import runs as tr
from fp8rl_core.tracking.store import Store

MISMATCH = {"bf16": 1.004, "fp8_gen": 1.06, "fp8_e2e": 1.02}
FINAL_ACC = {("bf16", "none"): 0.70, ("bf16", "token"): 0.70, ("fp8_gen", "none"): 0.52,
             ("fp8_gen", "token"): 0.66, ("fp8_e2e", "none"): 0.63, ("fp8_e2e", "token"): 0.69}
STEP_TIME = {"bf16": 1.0, "fp8_gen": 1.25, "fp8_e2e": 1.4}
MATCHED_MISMATCH = {"bf16": 1.0, "fp8_gen": 1.03, "fp8_e2e": 1.0}  # 1.0: exactly 1 at every step
EVAL_OFFSET = {"bf16": 0.0, "fp8_gen": -0.03, "fp8_e2e": -0.01}  # val_accuracy − val_accuracy_bf16_eval
CONST_STEPS = np.arange(8)


def synthetic_runs(recipes: Sequence[str] = ("bf16", "fp8_gen", "fp8_e2e"),
                   is_variants: Sequence[str] = ("none", "token"),
                   seeds: int = 3, steps: int = 21, val_every: int = 5, mismatch: Mapping[str, float] = MISMATCH,
                   final_acc: Mapping[tuple[str, str], float] = FINAL_ACC, acc0: float = 0.3,
                   seed_sd: float = 0.015, rng_seed: int = 0, shared_sd: float = 0.0,
                   spikes: Mapping[tuple[str, str, int], float] | None = None, tails: bool = False,
                   matched: Sequence[str] = (), matched_mismatch: Mapping[str, float] = MATCHED_MISMATCH,
                   bf16_eval: bool = False, eval_offset: Mapping[str, float] = EVAL_OFFSET) -> list[RunHistory]:
    """One RunHistory per (recipe, IS, seed), then one per (matched recipe, seed); their `metrics` are
    the exact values a test compares to."""
    rng = np.random.default_rng(rng_seed)
    shared = np.random.default_rng([rng_seed, 1]).normal(0, shared_sd, seeds) if shared_sd else np.zeros(seeds)
    eval_rng, matched_rng = np.random.default_rng([rng_seed, 2]), np.random.default_rng([rng_seed, 3])
    shape = _Shape(steps, val_every, acc0, tails)
    cells = [(recipe, isv, seed, DISTINCT, mismatch.get(recipe, 1.03))
             for recipe in recipes for isv in is_variants for seed in range(seeds)]
    cells += [(recipe, "none", seed, MATCHED, matched_mismatch.get(recipe, 1.03))
              for recipe in matched for seed in range(seeds)]
    runs = []
    for recipe, isv, seed, kernels, mm_mean in cells:
        metrics = shape.metrics(rng if kernels == DISTINCT else matched_rng, recipe, isv, mm_mean,
                                final_acc.get((recipe, isv), 0.6), shared[seed], seed_sd)
        if spikes and kernels == DISTINCT and (recipe, isv, seed) in spikes:
            mm = metrics[M_MISMATCH][1]
            mm[[steps // 4, steps // 2, (3 * steps) // 4]] = spikes[(recipe, isv, seed)]
            if tails:
                shape.add_tails(metrics)
        if bf16_eval:
            val_steps, acc = metrics[M_VAL_ACC]
            noise = eval_rng.normal(0, 0.003, acc.size) * (recipe != "bf16")
            metrics[M_VAL_ACC_BF16_EVAL] = (val_steps, acc - eval_offset.get(recipe, 0.0) + noise)
        suffix = "-matched" if kernels == MATCHED else ""
        tags = {TAG_RECIPE: recipe, TAG_IS: isv, TAG_SEED: str(seed), TAG_CELL_ID: f"{recipe}-{isv}-{seed}{suffix}"}
        params = {"recipe": recipe, "loss.importance_sampling": isv, "seed": str(seed), KERNELS_PARAM: kernels}
        runs.append(RunHistory("", f"{recipe}-{isv}-s{seed}{suffix}", FINISHED, tags, params, metrics))
    return runs


class _Shape:
    """The per-run histories of `synthetic_runs` (see the module docstring for the formulas)."""

    def __init__(self, steps: int, val_every: int, acc0: float, tails: bool):
        self.steps, self.acc0, self.tails = steps, acc0, tails
        self.all_steps = np.arange(steps, dtype=np.int64)
        self.val_steps = np.unique(np.r_[np.arange(0, steps, val_every), steps - 1]).astype(np.int64)

    def metrics(self, rng: np.random.Generator, recipe: str, isv: str, mm_mean: float, final: float,
                shared: float, seed_sd: float) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        steps, all_steps, val_steps = self.steps, self.all_steps, self.val_steps
        excess = mm_mean - 1.0  # the metric is >= 1 by definition: noise it multiplicatively (0 stays 0)
        mm = 1.0 + excess * np.exp(rng.normal(0, 0.15) + rng.normal(0, 0.08, steps))
        target = final + rng.normal(0, seed_sd) + shared
        acc = self.acc0 + (target - self.acc0) * val_steps / max(steps - 1, 1) + rng.normal(0, 0.004, val_steps.size)
        acc[-1] = target
        step_time = STEP_TIME.get(recipe, 1.0) * (1 + rng.normal(0, 0.02, steps))
        metrics = {
            M_MISMATCH: (all_steps, mm),
            M_VAL_ACC: (val_steps, acc),
            M_REWARD: (all_steps, np.interp(all_steps, val_steps, acc) + rng.normal(0, 0.02, steps)),
            M_IS_WEIGHT: (all_steps, 1 + rng.normal(0, 0.01, steps) * (isv != "none")),
            M_LOSS: (all_steps, 0.5 * np.exp(-all_steps / steps) + rng.normal(0, 0.01, steps)),
            M_STEP_TIME: (all_steps, step_time),
            M_TOKENS_PER_S: (all_steps, 1024 / step_time),
        }
        if self.tails:
            self.add_tails(metrics)
        return metrics

    @staticmethod
    def add_tails(metrics: dict) -> None:
        all_steps, mm = metrics[M_MISMATCH]
        for i, key in enumerate(FRAC_METRICS):
            metrics[key] = (all_steps, np.clip((mm - 1) * 10.0 ** -i, 0, 1))


def log_sweep(uri: str, experiment: str, sweep_name: str, runs: Sequence[RunHistory],
              config_dir: str | Path | None = None) -> str:
    """Write `runs` as a sweep (parent + child runs, through `fp8rl_core.tracking.runs`); sets each
    run's `run_id`; returns the parent run id. Metrics go in `log_batch` calls of <= 1000."""
    exp_id = tr.ensure_experiment(uri, experiment)
    parent = tr.create_parent_run(uri, experiment, sweep_name, params={"seeds": len({r.tags[TAG_SEED] for r in runs})},
                                  config={"experiment": experiment, "name": sweep_name})
    client = Store(uri)
    for run in runs:
        tags = {k: v for k, v in run.tags.items() if k != TAG_CELL_ID}
        run.run_id, _ = tr.find_or_create_cell_run(uri, exp_id, parent, run.tags[TAG_CELL_ID], tags=tags,
                                                   params=run.params, config=run.params, run_name=run.run_name)
        client.log_metric_points(run.run_id, [(k, v, 1_700_000_000_000 + int(s), s)
                                              for k, (steps, values) in run.metrics.items()
                                              for s, v in zip(steps, values)])
        client.set_terminated(run.run_id, run.status)
    return parent


def simulate_cells(rng: np.random.Generator, sims: int, seeds: int, means: Mapping[str, float],
                   seed_sd: float = 0.0, run_sd: float = 1.0) -> dict[str, np.ndarray]:
    """Per-run summaries of `sims` sweeps × `seeds` seeds for each cell in `means`: `{cell: [sims, seeds]}`,
    x = means[cell] + u_seed (sd `seed_sd`, shared by every cell of that seed) + e (sd `run_sd`, per run).
    A paired difference of two cells then has sd run_sd·√2, whatever seed_sd is."""
    shared = rng.normal(0.0, seed_sd, (sims, seeds))
    return {cell: mu + shared + rng.normal(0.0, run_sd, (sims, seeds)) for cell, mu in means.items()}


def constant_runs(mismatch: dict[str, list[float]] | None = None, acc: dict[tuple[str, str], list[float]] | None = None,
                  spikes: dict[tuple[str, int], float] | None = None,
                  acc_bf16_eval: dict[tuple[str, str], list[float]] | None = None) -> list[RunHistory]:
    """One run per cell with constant histories. `mismatch`: per recipe, one value per seed, logged by the
    IS none and token cells of that seed; `acc` (`acc_bf16_eval`): per (recipe, IS), one final
    val_accuracy (val_accuracy_bf16_eval) per seed; `spikes`: (recipe, seed) -> a value put on 2 of that
    seed's IS-none steps."""
    cells: dict[tuple[str, str, int], dict] = {}
    for recipe, values in (mismatch or {}).items():
        for seed, v in enumerate(values):
            for isv in ("none", "token"):
                mm = np.full(CONST_STEPS.size, v)
                if isv == "none" and spikes and (recipe, seed) in spikes:
                    mm[[2, 5]] = spikes[(recipe, seed)]
                cells.setdefault((recipe, isv, seed), {})[M_MISMATCH] = (CONST_STEPS, mm)
    for key, table in ((M_VAL_ACC, acc), (M_VAL_ACC_BF16_EVAL, acc_bf16_eval)):
        for (recipe, isv), values in (table or {}).items():
            for seed, v in enumerate(values):
                cells.setdefault((recipe, isv, seed), {})[key] = (CONST_STEPS[:4], np.r_[0.1, 0.2, 0.3, v])
    return [RunHistory(f"{r}-{i}-{s}", "", FINISHED, {TAG_RECIPE: r, TAG_IS: i, TAG_SEED: str(s)}, {}, m)
            for (r, i, s), m in cells.items()]
