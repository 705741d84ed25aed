"""Figure of the episode (docs/study/instability/README.md) from episode_series.json:

    python docs/study/instability/make_figure.py    # writes fig_episode.png next to this file
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent


def main() -> Path:
    rows = json.loads((HERE / "episode_series.json").read_text())
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True)
    mm = [(r["step"], r["token_mult_prob_error"]) for r in rows if r["token_mult_prob_error"] is not None]
    ax1.semilogy(*zip(*mm), color="C3", lw=1.2, label="token_mult_prob_error (trainer FP8 vs generation FP8)")
    ax1.axhline(1.1, color="k", ls=":", lw=1, label="1.1 (the report's episode band)")
    ax1.set_ylabel("mismatch")
    ax1.legend(loc="upper left", fontsize=8)
    ax2.axhspan(-1, 1, color="C1", alpha=0.15, label="|gap| < 1: FP8 rounding and kernel noise decide the mix")
    ax2.axhline(0, color="k", lw=0.6)
    ax2.plot(steps, [r["gap_bf16"]["5"] for r in rows], color="C0", label="BF16 weights")
    ax2.plot(steps, [r["gap_fp8_qk"]["5"] for r in rows], color="C3", ls="--", label="layer-0 q/k weights E4M3 [128,128]")
    ax2.set_ylabel("logit(BOS) − logit('=')")
    ax2.set_title("layer 0, head 2, query '=' at position 5 (e.g. 7+64=): where it attends", fontsize=9)
    ax2.legend(loc="upper right", fontsize=8)
    ax3.plot(steps[1:], [r["reward_mean"] for r in rows[1:]], color="C2", lw=1, label="reward (training batch)")
    val = [(r["step"], r["val_accuracy_bf16_eval"]) for r in rows if r["val_accuracy_bf16_eval"] is not None]
    ax3.plot(*zip(*val), "o-", color="k", label="validation accuracy, BF16 eval engine")
    ax3.set_ylim(0, 1)
    ax3.set_xlabel("RL step (checkpoint)")
    ax3.legend(loc="lower left", fontsize=8)
    fig.suptitle("fp8_e2e, token IS, seed 2 (AMD EPYC, emulated FP8 GEMMs): the 20-step episode", fontsize=10)
    fig.tight_layout()
    out = HERE / "fig_episode.png"
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main())
