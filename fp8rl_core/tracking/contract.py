"""The MLflow contract: every tag, metric, role and status name that the UI, `analysis/` and outside
tools read. These names never change; every producer (the run loop, the sink, the sweep driver) and
every reader (analysis, `sweep status`, the search) imports them from here, so no module spells one
as a string literal of its own (docs/design.md, section 4).

Why one module: a name written twice drifts, and a drifted name is a silent hole in a figure.
`fp8rl_core.tracking` re-exports every name below, so `from fp8rl_core.tracking import M_MISMATCH`
keeps working. Nothing here imports MLflow.
"""
from __future__ import annotations

# --- tags of the runs ---------------------------------------------------------------------------
TAG_SWEEP = "sweep"
TAG_CELL_ID = "cell_id"
TAG_RECIPE = "recipe"
TAG_IS = "importance_sampling"
TAG_SEED = "seed"
TAG_ROLE = "fp8rl.role"  # ROLE_SWEEP on the parent run, ROLE_CELL on each child
TAG_PARENT = "mlflow.parentRunId"  # MLflow's own: the UI nests child runs under their parent
CELL_TAGS = (TAG_SWEEP, TAG_CELL_ID, TAG_RECIPE, TAG_IS, TAG_SEED)
ROLE_SWEEP = "sweep"
ROLE_CELL = "cell"
# per attempt (tags, so that a resume on another node may differ): what computed it
TAG_BF16_COMPUTE = "fp8rl.bf16_compute"  # native | emulated | none (model.dtype fp32)
TAG_CPU_FLAGS = "fp8rl.cpu_flags"  # the CPU flags that decide the BF16 path and the kernels
TAG_FP8_GEMM = "fp8rl.fp8_gemm"  # the FP8 GEMM executor (fp8rl_core/fp8/gemm.py)
# how it was chosen (fp8rl_core/fp8/choice.py): pinned (fp8.gemm) | $FP8RL_GEMM | sweep (<file>: timings) |
# calibrated: timings | cached: timings | default (cuda: static rule); the same executor in every cell of a sweep
TAG_FP8_GEMM_CHOICE = "fp8rl.fp8_gemm_choice"
# (the FP8 GEMM preflight's tags fp8rl.preflight[.*] and metrics fp8_preflight_*: their home is
# fp8rl_core/fp8/preflight.py, TAG and METRICS; this module stays free of torch)
TAG_WORLD_SIZE = "world_size"  # ranks of the attempt (a resume may reshard)
TAG_ERROR = "fp8rl.error"  # the exception that ended a failed cell, shown in the MLflow UI
TAG_TRIAL = "optuna.trial"  # a search cell's Optuna trial number(s), comma-separated
TAG_BEST_PARAMS = "best_params"  # on a search's parent run: the best trial's params
# written on each child run by every sweep report (analysis/report.py; the band: analysis.episodes):
TAG_EPISODE = "fp8rl.episode"  # "true" / "false": the run had an instability episode
TAG_EPISODE_STEPS = "fp8rl.episode_steps"  # where: "54-76", "54-76; val 60,70", "val 60", or "none"
# The experiment's kind for MLflow 3.x UIs that read it (earlier 3.x, Databricks). MLflow 3.17 ignores it:
# its view comes from the browser (URL `?workflowType=machine_learning`, else local storage, default
# GenAI "Overview"), so links to the runs table carry that query (`analysis.links.ui_link`).
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}

# --- metrics ------------------------------------------------------------------------------------
M_MISMATCH = "token_mult_prob_error"
M_REWARD = "reward_mean"
M_VAL_ACC = "val_accuracy"
# the same validation prompts and samples through one BF16 generation engine, for every arm (the arm's
# own engine for bf16): separates "FP8 inference costs accuracy" from "FP8 mismatch harmed learning"
M_VAL_ACC_BF16_EVAL = "val_accuracy_bf16_eval"
M_IS_WEIGHT = "is_weight_mean"
M_LOSS = "loss"
M_STEP_TIME = "step_time_s"
M_TOKENS_PER_S = "tokens_per_s"  # optional; the summary table shows it when logged
# Tails of d = logprob_train - logprob_gen per step: the fraction of valid response tokens with |d| above
# 0.1, 1 and 10 nats (fp8rl_core/diagnostics/catalogue.py computes them; analysis/ summarizes them per run).
M_FRAC_GT_0P1 = "logprob_abs_diff_frac_gt_0.1"
M_FRAC_GT_1 = "logprob_abs_diff_frac_gt_1"
M_FRAC_GT_10 = "logprob_abs_diff_frac_gt_10"
TAIL_FRACTIONS = (M_FRAC_GT_0P1, M_FRAC_GT_1, M_FRAC_GT_10)
BEST_PREFIX = "best_"  # a search's parent run logs best_<search.metric>
# The mismatch guard (train.mismatch_guard, off by default; fp8rl_core/engines/guard.py), every step while it
# is on: whether the step's update was skipped (0/1; with micro_steps > 1 the share of its optimizer steps)
# and the share of its sequences left out of the loss. Not in STEP_METRICS: a run without the guard has none.
M_GUARD_SKIPPED = "guard_skipped"
M_GUARD_MASKED_FRACTION = "guard_masked_fraction"
# The E4M3 KV cache (fp8.kv_cache e4m3, fp8rl_core/engines/kv_quant.py), every step while it is on: the training
# step whose weights the KV scales of the step's rollout were computed with (the refit's step for first_forward,
# the generating weights' step for per_token_head), and a checksum of those scales (crc32 of their FP32 bytes,
# 24 bits: exact as a float). Not in STEP_METRICS: a run with the cache in the compute dtype has none.
M_KV_SCALE_STEP = "kv_scale_step"
M_KV_SCALE_CHECKSUM = "kv_scale_checksum"
# What every training step logs, and what every validation step (step 0 and every val_every) adds.
STEP_METRICS = (M_MISMATCH, M_REWARD, M_IS_WEIGHT, M_LOSS, M_STEP_TIME, *TAIL_FRACTIONS)
VALIDATION_METRICS = (M_VAL_ACC, M_VAL_ACC_BF16_EVAL)
# the metrics a search may optimize and a report may read (order kept: KNOWN_METRICS lists it)
CONTRACT_METRICS = (M_MISMATCH, M_REWARD, M_VAL_ACC, M_IS_WEIGHT, M_LOSS, M_STEP_TIME, *TAIL_FRACTIONS)

# --- run statuses (MLflow's) --------------------------------------------------------------------
SCHEDULED, RUNNING, FINISHED, FAILED, KILLED = "SCHEDULED", "RUNNING", "FINISHED", "FAILED", "KILLED"
OPEN_STATUSES = (SCHEDULED, RUNNING)
END_STATUSES = (FINISHED, FAILED, KILLED)
# two runs of one cell (two drivers at one instant): the best status speaks for the cell
STATUS_RANK = {FINISHED: 5, RUNNING: 4, SCHEDULED: 3, FAILED: 2, KILLED: 1}

# --- files ----------------------------------------------------------------------------------------
METRICS_FILE = "metrics.jsonl"  # the run's append-only buffer, under its output_dir

__all__ = [name for name in list(globals()) if name.isupper()]  # the names above, for `tracking`
