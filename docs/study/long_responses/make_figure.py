"""The side study's figure: accuracy (one BF16 evaluation engine) per step, bf16 vs fp8_gen, per rollout
temperature, mean ± 95% t band over seeds, read back from MLflow.

    python docs/study/long_responses/make_figure.py sqlite:///mlflow.db docs/study/long_responses/fig.png
(in the folder where `sweep run sweeps/fp8_long_responses.yaml` ran)."""
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

from analysis.fetch import fetch_sweep  # noqa: E402

uri, out = sys.argv[1], sys.argv[2]
curves = defaultdict(list)  # (T, recipe) -> [(steps, values)]
for run in fetch_sweep(uri, "fp8_long_responses", sweep_name="fp8_long_responses").runs:
    curves[(float(run.params["rollout.temperature"]), run.tags["recipe"])].append(run.series("val_accuracy_bf16_eval"))
temps = sorted({t for t, _ in curves})
fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 3.6), sharey=False)
for ax, t in zip(np.atleast_1d(axes), temps):
    for recipe, color in (("bf16", "#0072B2"), ("fp8_gen", "#D55E00")):
        runs = curves[(t, recipe)]
        steps = runs[0][0]
        vals = np.array([v for _, v in runs]) * 100
        mean, n = vals.mean(0), len(vals)
        half = stats.t.ppf(0.975, n - 1) * vals.std(0, ddof=1) / np.sqrt(n) if n > 1 else 0 * mean
        ax.plot(steps, mean, marker="o", color=color, label=f"{recipe} ({n} seeds)")
        ax.fill_between(steps, mean - half, mean + half, color=color, alpha=0.15)
    ax.set_title(f"scratchpad task, rollout T = {t:g}")
    ax.set_xlabel("RL step")
    ax.set_ylabel("val accuracy, BF16 eval engine (%)")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
fig.suptitle("Longer responses (~23 tokens): does FP8 generation cost accuracy? mean ± 95% t band")
fig.tight_layout()
fig.savefig(out, dpi=130)
