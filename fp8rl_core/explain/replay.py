"""The attribution replay behind `fp8rl-train explain`: where does a run's generation/training mismatch
come from? Computation only, it returns data; the report (report.md, per_layer.png, results.json), its
MLflow logging and the CLI are analysis/explain.py.

    step, results = explain(run_dir, variants=["bf16", "kernels"], rows=16)  # the newest replayable step
    worst = worst_recorded(run_dir, step)      # the recorded batch's worst tokens (list[dict])

Reloads the weights that generated a saved rollout batch (`rollouts/step_N.pt`, written by the run
next to checkpoint N − 1; fp8rl_core/diagnostics/tokens.py) and re-scores the batch under controlled
variants, each a pair (side A plays the trainer, side B the generator; fp8rl_core/explain/attribution.py):

    bf16         training kernels, BF16   vs the same                    (control: must be exactly 1.0)
    weights      training kernels, BF16   vs + weights fake-quantized E4M3 [128,128]
    activations  training kernels, BF16   vs + activations fake-quantized E4M3 [1,128]
    both         training kernels, BF16   vs + both (FP8 GEMM numerics)
    kernels      training kernels, BF16   vs generation-engine kernels, BF16
    as_run       the run's training engine vs its generation engine, FP8 per the recipe (prefill path)
and `recorded`, the numbers the run logged for this batch (decode path, KV cache). For each: the
catalogue's metrics and each decoder layer's relative hidden-state error.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.config import RunConfig, recipe_of, resolve_recipe, run_config_from_dict
from fp8rl_core.diagnostics.catalogue import step_diagnostics
from fp8rl_core.diagnostics.tokens import ROLLOUTS_DIR, find_checkpoint, worst_tokens
from fp8rl_core.engines.kv_quant import KVScales
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.explain.attribution import GenKernels, TrainKernels, VariantResult, compare
from fp8rl_core.io import checkpoint as ckpt
from fp8rl_core.loop.builder import initial_checkpoint, load_tokenizer, resolve_setup
from fp8rl_core.model import load_pretrained
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.fp8_policy import apply_fp8, quantize_source
from fp8rl_core.model.llama import CausalLM

VARIANTS = {
    "bf16": "BF16 in both engines (training kernels on both sides): the replay's own noise floor",
    "weights": "weight quantization only (E4M3 [128,128], activations BF16)",
    "activations": "activation quantization only (E4M3 [1,128], weights BF16)",
    "both": "weights and activations quantized (FP8 GEMM numerics)",
    "kernels": "generation-engine kernels vs training-engine kernels, both BF16",
    "as_run": "the run's engines as the recipe builds them (generation prefill path)",
}


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

    if ckpt.is_legacy(ckpt_path):
        return ckpt.load_legacy(ckpt_path)[0]
    weights = dict(CausalLM(model_config).state_dict())
    ckpt.load_checkpoint(ckpt_path, {ckpt.TRAIN_KEY: {"model": weights}}, partial=True)
    return weights


def generating_weights(run_dir: Path, cfg: RunConfig, model_config: ModelConfig, weights_step: int
                       ) -> dict[str, torch.Tensor]:
    """The weights of checkpoint `weights_step` (0: the run's initial weights, the cached warm start)."""
    if weights_step == 0:
        path = initial_checkpoint(resolve_setup(cfg, "cpu"), progress=False)
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
def rollout_kv_scales(r: dict[str, Any]) -> KVScales | None:
    """The per-layer KV scales a saved rollout was generated with (diagnostics.save_rollout), None when it
    holds none (the cache in the dtype, per_token_head, or a rollout saved before they were kept)."""
    if r.get("kv_scales_k") is None:
        return None
    return KVScales(r["kv_scales_k"], r["kv_scales_v"], int(r["kv_scales_step"]), r.get("kv_scales_amax_k"),
                    r.get("kv_scales_amax_v"))


def build_variants(names: list[str], weights: dict[str, torch.Tensor], cfg: RunConfig, model_config: ModelConfig,
                   kv_scales: KVScales | None = None):
    """(name, side A, side B) for each requested variant. kv_scales: the rollout's KV scales
    (rollout_kv_scales); the FP8 generation side is refit with them, so that its cache holds what the
    rollout's did."""

    model = CausalLM(model_config)
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    temp, recipe = cfg.rollout.temperature, recipe_of(cfg)
    both = resolve_recipe("fp8_e2e", cfg.fp8)  # the run's FP8 knobs on both sides: what the variants quantize
    if both.kv_cache == "e4m3" and both.kv_scale == "trainer" and kv_scales is None:
        # a rollout saved before the KV scales were kept with it: the replay's cache stays in the dtype (the
        # engine would refuse to run without the scales of these weights; engines/kv_quant.py)
        both = dataclasses.replace(both, kv_cache="auto")
    dtype = torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32
    excl, p2 = both.fp8_exclusions(model_config.num_hidden_layers), both.training.power_of_two_scales
    source = quantize_source(both.training, dtype)  # what the run's engines round a weight to before Q(W)
    ref = TrainKernels(model, "train BF16", temperature=temp, compute_dtype=dtype)

    def train(name: str, w: bool, a: bool) -> TrainKernels:
        return TrainKernels(model, name, temperature=temp, compute_dtype=dtype, quant_weights=w, quant_activations=a,
                            exclude=excl, power_of_two=p2, quantize_dtype=source)

    def gen(fp8: bool) -> GenKernels:
        engine = NativeGenerationEngine(model_config, recipe=both if fp8 else both.in_bf16(), dtype=dtype,
                                        device="cpu", seed=0)
        if kv_scales is not None and fp8 and both.kv_cache == "e4m3":  # the rollout's (trainer, first_forward)
            engine.refit(weights, step=kv_scales.step, kv_scales=kv_scales)
        else:
            engine.refit(weights)
        return GenKernels(engine, f"gen {'FP8' if fp8 else 'BF16'}", temperature=temp)

    make = {
        "bf16": lambda: (ref, ref),
        "weights": lambda: (ref, train("train W-FP8", True, False)),
        "activations": lambda: (ref, train("train A-FP8", False, True)),
        "both": lambda: (ref, train("train W+A-FP8", True, True)),
        "kernels": lambda: (ref, gen(False)),
        "as_run": lambda: (_as_run_trainer(model, recipe, temp, dtype), gen(recipe.fp8_generation)),
    }
    for name in names:
        yield (name, *make[name]())


def _as_run_trainer(model, recipe, temp: float, dtype) -> TrainKernels:
    side = TrainKernels(model, f"train {'FP8' if recipe.fp8_training else 'BF16'}", temperature=temp,
                        compute_dtype=dtype)
    if recipe.fp8_training:
        apply_fp8(side.model, recipe, dtype)  # the real Fp8Linear forward (and weight source) the run's trainer uses
    return side


def explain(run_dir: Path, step: int | None = None, variants: list[str] | None = None,
            rows: int | None = None) -> tuple[int, list[VariantResult]]:
    """Replay one saved rollout (default: the newest replayable one) under `variants` (default: all)."""

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
        hf = json.loads((initial_checkpoint(resolve_setup(cfg, "cpu"), False) / "config.json").read_text())
    model_config = ModelConfig.from_hf_dict(hf)
    weights = generating_weights(run_dir, cfg, model_config, int(r["weights_step"]))
    n = r["input_ids"].shape[0] if rows is None else min(rows, r["input_ids"].shape[0])
    ids, am, rm = r["input_ids"][:n], r["attention_mask"][:n], r["response_mask"][:n]
    # the advantages, where the rollout saved them (the catalogue's adv_pos / adv_neg splits; else nan)
    adv = None if r.get("advantages") is None else r["advantages"][:n]
    results = [VariantResult("recorded", "what the run logged for this batch (generation decode path with KV cache)",
                             step_diagnostics(r["old_logprobs"][:n], r["gen_logprobs"][:n], rm,
                                              None if r.get("is_weights") is None else r["is_weights"][:n],
                                              advantages=adv))]
    for name, a, b in build_variants(variants or list(VARIANTS), weights, cfg, model_config, rollout_kv_scales(r)):
        results.append(compare(a, b, ids, am, rm, name=name, description=f"{VARIANTS[name]} [{a.name} vs {b.name}]",
                               advantages=adv))
    return step, results


# --- the recorded batch's worst tokens ----------------------------------------------------------------
def worst_recorded(run_dir: Path, step: int, k: int = 3) -> list[dict[str, Any]]:
    """The k worst tokens of the recorded batch (as the run's worst-token table lists them)."""

    r = load_rollout(run_dir, step)
    tok = load_tokenizer(run_config_from_dict(json.loads(r["run_config"])))
    return worst_tokens(r["input_ids"], r["attention_mask"], r["response_mask"], r["old_logprobs"],
                        r["gen_logprobs"], r.get("is_weights"), tok, k, 12, step)
