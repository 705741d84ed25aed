"""fp8rl-train explain: where does a run's generation/training mismatch come from?

    fp8rl-train explain runs/fp8_gen_s1                 # the newest replayable step
    fp8rl-train explain runs/fp8_gen_s1 --step 51 --rows 16 --variants bf16,weights,activations,both,kernels

Writes report.md, per_layer.png and results.json to `<run>/diagnostics/explain_step_N/`, prints the
Markdown, and logs the folder to the run's MLflow run (when it has one) under `diagnostics/explain_step_N`.
The replay and its variants (below, in --help) are fp8rl_core/explain/replay.py.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from fp8rl_core.diagnostics.catalogue import (
    M_ABS_DIFF_MAX,
    M_ABS_DIFF_MEDIAN,
    M_ABS_DIFF_P95,
    M_ABS_DIFF_TRIMMED,
    M_FRACTION,
    M_GEN_KL,
    M_K2_KL,
    M_SPLIT,
)
from fp8rl_core.explain import replay
from fp8rl_core.explain.attribution import VariantResult
from fp8rl_core.explain.replay import VARIANTS, explain, load_rollout, worst_recorded
from fp8rl_core.tracking import M_FRAC_GT_1, M_MISMATCH
from fp8rl_core.tracking.sink import RUN_ID_FILE
from fp8rl_core.tracking.store import Store

# The report and CLI of the attribution replay; the replay itself (rollout and weights loading, the
# variants, the comparison, the worst tokens) is fp8rl_core/explain/replay.py, which returns data.
SUMMARY_KEYS = (M_MISMATCH, M_GEN_KL, M_ABS_DIFF_MAX, M_FRAC_GT_1)
# the peers' other views of the same tokens (issue 34): one row per metric, one column per variant; shown
# when a result has any of them (results.json keeps every catalogue metric)
VIEW_KEYS = (M_ABS_DIFF_MEDIAN, M_ABS_DIFF_P95, M_ABS_DIFF_TRIMMED, M_K2_KL,
             *(M_SPLIT[s]["mult"] for s in ("adv_pos", "adv_neg", "is_masked", "is_kept")),
             M_FRACTION["is_masked"])


def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.6f}" if abs(x) < 1e4 else f"{x:.4g}"


def markdown(step: int, results: list[VariantResult], worst: list[dict[str, Any]] = ()) -> str:
    """The summary table (one row per variant), the per-layer table (one column per variant) and the
    recorded batch's worst tokens."""
    lines = [f"## Mismatch attribution, step {step}", "",
             "| variant | " + " | ".join(SUMMARY_KEYS) + " | first divergent layer | largest jump at layer |",
             "|---" * (len(SUMMARY_KEYS) + 3) + "|"]
    for v in results:
        layer = lambda x: "—" if x is None else str(x)  # noqa: E731
        lines.append(f"| {v.name} | " + " | ".join(_fmt(v.metrics.get(k, math.nan)) for k in SUMMARY_KEYS)
                     + f" | {layer(v.first_divergent_layer) if v.layer_rel_err else '—'}"
                     f" | {layer(v.largest_jump_layer) if v.layer_rel_err else '—'} |")
    if any(k in v.metrics for v in results for k in VIEW_KEYS):
        lines += ["", "Other views of the mismatch (median, p95, trimmed mean of |Δ log p|; k2 KL; splits by "
                  "advantage sign and IS mask):", "",
                  "| metric | " + " | ".join(v.name for v in results) + " |", "|---" * (len(results) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(_fmt(v.metrics.get(k, math.nan)) for v in results) + " |" for k in VIEW_KEYS]
    layered = [v for v in results if v.layer_rel_err]
    if layered:
        lines += ["", "Relative hidden-state error ||h_A − h_B|| / ||h_A|| after each decoder layer:", "",
                  "| layer | " + " | ".join(v.name for v in layered) + " |", "|---" * (len(layered) + 1) + "|"]
        for i in range(max(len(v.layer_rel_err) for v in layered)):
            lines.append(f"| {i} | " + " | ".join(f"{v.layer_rel_err[i]:.3e}" if i < len(v.layer_rel_err) else "—"
                                                   for v in layered) + " |")
    if worst:
        lines += ["", "Worst tokens of the recorded batch:", "",
                  "| row | position | context | token | train logprob | gen logprob | abs diff |", "|---" * 7 + "|"]
        lines += [f"| {w['row']} | {w['position']} | `{w['context']}` | `{w['token']}` | {w['train_logprob']:.4f}"
                  f" | {w['gen_logprob']:.4f} | {w['abs_diff']:.4g} |" for w in worst]
    lines += ["", "Variants:"] + [f"- **{v.name}**: {v.description}" for v in results]
    return "\n".join(lines) + "\n"


def figure(step: int, results: list[VariantResult], path: Path) -> Path | None:
    """Per-layer relative error, one line per variant (log scale; exact zeros drawn at the axis floor)."""
    layered = [v for v in results if v.layer_rel_err]
    if not layered:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    positive = [e for v in layered for e in v.layer_rel_err if e > 0 and not math.isnan(e)]
    floor = min(positive) / 10 if positive else 1e-12
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for v in layered:
        label = v.name + (" (exactly 0, drawn at the floor)" if not any(e > 0 for e in v.layer_rel_err) else "")
        ax.plot(range(len(v.layer_rel_err)), [max(e, floor) for e in v.layer_rel_err], marker="o", label=label)
    ax.set_xticks(range(max(len(v.layer_rel_err) for v in layered)))
    ax.set_yscale("log")
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("relative hidden-state error")
    ax.set_title(f"Where the engines' disagreement grows (step {step})")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(run_dir: Path, step: int, results: list[VariantResult], worst: list[dict[str, Any]] = ()) -> Path:
    out = run_dir / "diagnostics" / f"explain_step_{step:08d}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(markdown(step, results, worst))
    (out / "results.json").write_text(json.dumps(
        [{"name": v.name, "description": v.description, "metrics": v.metrics, "layer_rel_err": v.layer_rel_err,
          "first_divergent_layer": v.first_divergent_layer, "largest_jump_layer": v.largest_jump_layer}
         for v in results], indent=1))
    figure(step, results, out / "per_layer.png")
    return out


def log_to_mlflow(run_dir: Path, cfg_tracking: Any, folder: Path) -> str | None:
    """Log `folder` as artifacts of the run's MLflow run; returns the run id (None: the run has none)."""
    uri = getattr(cfg_tracking, "uri", None)
    run_id = getattr(cfg_tracking, "run_id", None)
    if run_id is None and (run_dir / RUN_ID_FILE).exists():
        run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    if not uri or not run_id:
        return None
    Store(uri).log_artifacts(run_id, str(folder), f"diagnostics/{folder.name}")
    return run_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fp8rl-train explain", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=f"{__doc__}\n{replay.__doc__[replay.__doc__.index('Reloads'):]}")
    ap.add_argument("run_dir", help="the run's output_dir (holds rollouts/ and checkpoints/)")
    ap.add_argument("--step", type=int, help="the step whose rollout to replay (default: the newest replayable)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--rows", type=int, help="replay only the first N sequences of the batch (default: all)")
    ap.add_argument("--no-mlflow", action="store_true", help="do not log the report to the run's MLflow run")
    args = ap.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad:
        print(f"fp8rl-train explain: unknown variant(s) {bad}; valid: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    try:
        step, results = explain(run_dir, args.step, names, args.rows)
    except FileNotFoundError as e:
        print(f"fp8rl-train explain: {e}", file=sys.stderr)
        return 2
    worst = worst_recorded(run_dir, step)
    folder = write_report(run_dir, step, results, worst)
    print(markdown(step, results, worst), end="")
    print(f"\nwritten: {folder}/report.md, per_layer.png, results.json")
    if not args.no_mlflow:
        from fp8rl_core.config import run_config_from_dict

        cfg = run_config_from_dict(json.loads(load_rollout(run_dir, step)["run_config"]))
        run_id = log_to_mlflow(run_dir, cfg.tracking, folder)
        if run_id:
            print(f"logged to MLflow run {run_id} under diagnostics/{folder.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
