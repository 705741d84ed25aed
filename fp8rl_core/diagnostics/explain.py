"""fp8rl-train explain: where does a run's generation/training mismatch come from?

    fp8rl-train explain runs/fp8_gen_s1                 # the newest replayable step
    fp8rl-train explain runs/fp8_gen_s1 --step 51 --rows 16 --variants bf16,weights,activations,both,kernels

Reloads the weights that generated a saved rollout batch (`rollouts/step_N.pt`, written by the run
next to checkpoint N − 1; fp8rl_core/diagnostics/tokens.py) and re-scores the batch under controlled
variants, each a pair (side A plays the trainer, side B the generator; fp8rl_core/diagnostics/attribution.py):

    bf16         training kernels, BF16   vs the same                    (control: must be exactly 1.0)
    weights      training kernels, BF16   vs + weights fake-quantized E4M3 [128,128]
    activations  training kernels, BF16   vs + activations fake-quantized E4M3 [1,128]
    both         training kernels, BF16   vs + both (FP8 GEMM numerics)
    kernels      training kernels, BF16   vs generation-engine kernels, BF16
    as_run       the run's training engine vs its generation engine, FP8 per the recipe (prefill path)
and `recorded`, the numbers the run logged for this batch (decode path, KV cache). For each: the
catalogue's metrics and each decoder layer's relative hidden-state error. Writes report.md,
per_layer.png and results.json to `<run>/diagnostics/explain_step_N/`, prints the Markdown, and logs
the folder to the run's MLflow run (when it has one) under `diagnostics/explain_step_N`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.diagnostics.attribution import GenKernels, TrainKernels, VariantResult, compare
from fp8rl_core.diagnostics.catalogue import step_diagnostics
from fp8rl_core.diagnostics.tokens import ROLLOUTS_DIR, find_checkpoint

VARIANTS = {
    "bf16": "BF16 in both engines (training kernels on both sides): the replay's own noise floor",
    "weights": "weight quantization only (E4M3 [128,128], activations BF16)",
    "activations": "activation quantization only (E4M3 [1,128], weights BF16)",
    "both": "weights and activations quantized (FP8 GEMM numerics)",
    "kernels": "generation-engine kernels vs training-engine kernels, both BF16",
    "as_run": "the run's engines as the recipe builds them (generation prefill path)",
}
SUMMARY_KEYS = ("token_mult_prob_error", "gen_kl_error", "logprob_abs_diff_max", "logprob_abs_diff_frac_gt_1")


# --- inputs: the rollout and the weights that generated it ---------------------------------------------
def rollout_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in (run_dir / ROLLOUTS_DIR).glob("step_*.pt"))


def load_rollout(run_dir: Path, step: int) -> dict[str, Any]:
    path = run_dir / ROLLOUTS_DIR / f"step_{step:08d}.pt"
    if not path.exists():
        have = rollout_steps(run_dir)
        raise FileNotFoundError(f"{path}: no saved rollout for step {step}; saved: {have or 'none'} "
                                "(the run saves the batch generated from each checkpoint's weights: "
                                "diagnostics.save_rollouts)")
    return torch.load(path, weights_only=True)


def load_policy_weights(ckpt_path: Path, model_config: Any) -> dict[str, torch.Tensor]:
    """HF-named FP32 weights of the policy in a run checkpoint. The one adapter to fp8rl_core.io.checkpoint:
    its DCP format (load_checkpoint into a model state dict, as its export does) or the legacy one."""
    from fp8rl_core.io import checkpoint as ckpt
    from fp8rl_core.model.llama import CausalLM

    if hasattr(ckpt, "is_legacy") and ckpt.is_legacy(ckpt_path):
        return ckpt.load_legacy(ckpt_path)[0]
    if hasattr(ckpt, "TRAIN_KEY"):
        weights = dict(CausalLM(model_config).state_dict())
        ckpt.load_checkpoint(ckpt_path, {ckpt.TRAIN_KEY: {"model": weights}}, partial=True)
        return weights
    return ckpt.load_checkpoint(ckpt_path)[0]  # the pre-DCP API: (weights, state, meta)


def generating_weights(run_dir: Path, cfg: Any, model_config: Any, weights_step: int) -> dict[str, torch.Tensor]:
    """The weights of checkpoint `weights_step` (0: the run's initial weights, the cached warm start)."""
    if weights_step == 0:
        from fp8rl_core.loop.builder import initial_checkpoint, load_tokenizer
        from fp8rl_core.model import load_pretrained
        from fp8rl_core.tasks import make_task

        path = initial_checkpoint(cfg, load_tokenizer(cfg), make_task(cfg.task), progress=False)
        return dict(load_pretrained(path, dtype=torch.float32).state_dict())
    found = find_checkpoint(run_dir / "checkpoints", weights_step)
    if found is None:
        raise FileNotFoundError(f"{run_dir}/checkpoints: checkpoint {weights_step} (the weights that generated "
                                f"rollout {weights_step + 1}) is gone (old checkpoints are pruned); replayable "
                                f"steps: {replayable_steps(run_dir)}")
    return load_policy_weights(found, model_config)


def replayable_steps(run_dir: Path) -> list[int]:
    return [s for s in rollout_steps(run_dir) if s == 1 or find_checkpoint(run_dir / "checkpoints", s - 1)]


# --- the variants -------------------------------------------------------------------------------------
def build_variants(names: list[str], weights: dict[str, torch.Tensor], cfg: Any, model_config: Any):
    """(name, side A, side B) for each requested variant."""
    from fp8rl_core.config.recipe import get_recipe
    from fp8rl_core.engines.native_gen import NativeGenerationEngine
    from fp8rl_core.model.fp8_policy import fp8_exclusions
    from fp8rl_core.model.llama import CausalLM

    model = CausalLM(model_config)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    temp, spec = cfg.rollout.temperature, cfg.fp8
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    excl, p2 = fp8_exclusions(model_config, spec), spec.power_of_two_scales
    ref = TrainKernels(model, "train BF16", temperature=temp, compute_dtype=dtype)

    def train(name: str, w: bool, a: bool) -> TrainKernels:
        return TrainKernels(model, name, temperature=temp, compute_dtype=dtype, quant_weights=w, quant_activations=a,
                            exclude=excl, power_of_two=p2)

    def gen(fp8: bool) -> GenKernels:
        engine = NativeGenerationEngine(model_config, fp8=fp8, fp8_spec=spec, dtype=dtype, device="cpu", seed=0)
        engine.refit(weights)
        return GenKernels(engine, f"gen {'FP8' if fp8 else 'BF16'}", temperature=temp)

    recipe = get_recipe(cfg.recipe)
    make = {
        "bf16": lambda: (ref, ref),
        "weights": lambda: (ref, train("train W-FP8", True, False)),
        "activations": lambda: (ref, train("train A-FP8", False, True)),
        "both": lambda: (ref, train("train W+A-FP8", True, True)),
        "kernels": lambda: (ref, gen(False)),
        "as_run": lambda: (_as_run_trainer(model, cfg, recipe.fp8_training, temp, dtype), gen(recipe.fp8_generation)),
    }
    for name in names:
        yield (name, *make[name]())


def _as_run_trainer(model, cfg, fp8_training: bool, temp: float, dtype) -> TrainKernels:
    side = TrainKernels(model, f"train {'FP8' if fp8_training else 'BF16'}", temperature=temp, compute_dtype=dtype)
    if fp8_training:
        from fp8rl_core.model.fp8_policy import apply_fp8

        apply_fp8(side.model, cfg.fp8, dtype)  # the real Fp8Linear forward (and weight source) the run's trainer uses
    return side


def explain(run_dir: Path, step: int | None = None, variants: list[str] | None = None,
            rows: int | None = None) -> tuple[int, list[VariantResult]]:
    """Replay one saved rollout (default: the newest replayable one) under `variants` (default: all)."""
    from fp8rl_core.config import run_config_from_dict
    from fp8rl_core.model.config import ModelConfig

    if step is None:
        have = replayable_steps(run_dir)
        if not have:
            raise FileNotFoundError(f"{run_dir}: no replayable rollout (rollouts/step_N.pt with checkpoint N-1); "
                                    f"saved rollouts: {rollout_steps(run_dir) or 'none'}")
        step = have[-1]
    r = load_rollout(run_dir, step)
    cfg = run_config_from_dict(json.loads(r["run_config"]), where=f"{run_dir} rollout {step}")
    hf = json.loads(r["model_config"]) if r.get("model_config") not in (None, "{}") else None
    if hf is None:
        from fp8rl_core.loop.builder import initial_checkpoint, load_tokenizer
        from fp8rl_core.tasks import make_task

        hf = json.loads((initial_checkpoint(cfg, load_tokenizer(cfg), make_task(cfg.task), False)
                         / "config.json").read_text())
    model_config = ModelConfig.from_hf_dict(hf)
    weights = generating_weights(run_dir, cfg, model_config, int(r["weights_step"]))
    n = r["input_ids"].shape[0] if rows is None else min(rows, r["input_ids"].shape[0])
    ids, am, rm = r["input_ids"][:n], r["attention_mask"][:n], r["response_mask"][:n]
    results = [VariantResult("recorded", "what the run logged for this batch (generation decode path with KV cache)",
                             step_diagnostics(r["old_logprobs"][:n], r["gen_logprobs"][:n], rm,
                                              None if r.get("is_weights") is None else r["is_weights"][:n]))]
    for name, a, b in build_variants(variants or list(VARIANTS), weights, cfg, model_config):
        results.append(compare(a, b, ids, am, rm, name=name, description=f"{VARIANTS[name]} [{a.name} vs {b.name}]"))
    return step, results


# --- reporting ----------------------------------------------------------------------------------------
def _fmt(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.6f}" if abs(x) < 1e4 else f"{x:.4g}"


def worst_recorded(run_dir: Path, step: int, k: int = 3) -> list[dict[str, Any]]:
    """The k worst tokens of the recorded batch (as the run's worst-token table lists them)."""
    from fp8rl_core.config import run_config_from_dict
    from fp8rl_core.diagnostics.tokens import worst_tokens
    from fp8rl_core.loop.builder import load_tokenizer

    r = load_rollout(run_dir, step)
    tok = load_tokenizer(run_config_from_dict(json.loads(r["run_config"])))
    return worst_tokens(r["input_ids"], r["attention_mask"], r["response_mask"], r["old_logprobs"],
                        r["gen_logprobs"], r.get("is_weights"), tok, k, 12, step)


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
    from fp8rl_core.tracking.sink import RUN_ID_FILE

    uri = getattr(cfg_tracking, "uri", None)
    run_id = getattr(cfg_tracking, "run_id", None)
    if run_id is None and (run_dir / RUN_ID_FILE).exists():
        run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    if not uri or not run_id:
        return None
    from mlflow import MlflowClient

    MlflowClient(uri).log_artifacts(run_id, str(folder), f"diagnostics/{folder.name}")
    return run_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fp8rl-train explain", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
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
