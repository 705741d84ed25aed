"""The FP8 GEMM preflight of a cell (fp8/preflight.py): its M values and GEMM shapes, from the cell's config
alone (the launcher plans with them: launchers/plan/preflight.py), and the check itself, which
loop/builder.py runs on every rank once the model's config is known and before any engine is built: a
failure ends the cell there. Its result travels as numerics tags (`fp8rl.preflight.*`), which run.py also
logs as metrics (docs/design.md, "FP8 GEMM preflight").
"""
from __future__ import annotations

import os

import torch

from fp8rl_core.config import RunConfig, recipe_of
from fp8rl_core.config.recipe import Recipe
from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.fp8 import preflight
from fp8rl_core.model.config import ModelConfig

PREFLIGHT_ENV = "FP8RL_PREFLIGHT"  # "0": skip the FP8 GEMM preflight (debugging only; the run is tagged)


def preflight_ms(cfg: RunConfig, world_size: int = 1, device: str = "cuda", recipe: Recipe | None = None
                 ) -> tuple[int, ...]:
    """The M values of the FP8 GEMM preflight: on CUDA a decode-sized M (this rank's rows, decoded at once),
    a training-sized M (a micro-batch's tokens, as the memory plan counts them) and, where the native engine
    generates in FP8, the rollout's largest: its prefill of every distinct prompt of the rank at the longest
    allowed prompt length (P / W x prompt tokens: native_gen groups equal-length prompts into one GEMM); on
    the CPU the small preflight.CPU_MS (docs/design.md, "FP8 GEMM preflight"). recipe None: config.recipe_of."""
    if torch.device(device).type != "cuda":
        return preflight.CPU_MS
    from fp8rl_core.distributed.memory_plan import layout_for_run

    lay = layout_for_run(cfg, world_size, device="cuda")
    ms = [lay.rows_per_rank, (lay.micro_batch_size or lay.rows_per_rank) * lay.tokens]
    if (recipe if recipe is not None else recipe_of(cfg)).fp8_generation and cfg.engines.generation == "native":
        ms.append(-(-cfg.rollout.prompts_per_step // world_size) * lay.prompt_tokens)
    return tuple(dict.fromkeys(ms))


def preflight_shapes(cfg: RunConfig, model_config: ModelConfig, world_size: int = 1, device: str = "cuda",
                     ms: tuple[int, ...] | None = None, recipe: Recipe | None = None) -> list[preflight.GemmShape]:
    """Every distinct GEMM that the cell's FP8 layers run on our executors (fp8/preflight.py): those of a
    native trainer training in block128 and of a native generation engine generating in block128 (vLLM,
    Megatron-Core and the other formats run other kernels). ms None: preflight_ms; recipe None:
    config.recipe_of (a run hands in its setup's)."""
    recipe = recipe if recipe is not None else recipe_of(cfg)
    ours = lambda quant, engine: quant is not None and quant.format == "block128" and engine == "native"  # noqa: E731
    training, generation = ours(recipe.training, cfg.engines.training), ours(recipe.generation, cfg.engines.generation)
    layers = model_config.num_hidden_layers
    blocks, head = len(recipe.bf16_blocks(layers)) < layers, recipe.lm_head == "fp8"
    if not (training or generation) or not (blocks or head):
        return []
    return preflight.model_shapes(model_config, ms or preflight_ms(cfg, world_size, device, recipe), lm_head=head,
                                  training=training, generation=generation, blocks=blocks)


def gemm_preflight(cfg: RunConfig, model_config: ModelConfig, device: str, mesh: Mesh = SINGLE,
                   recipe: Recipe | None = None) -> dict[str, str]:
    """The FP8 GEMM preflight on this rank's device, before any engine is built: its MLflow tags
    (PreflightResult.as_params), {} when no FP8 GEMM runs on our executors. Every rank checks its own
    device; when any fails, every rank raises PreflightError (one all-reduce), none waits alone."""
    shapes = preflight_shapes(cfg, model_config, mesh.world_size, device, recipe=recipe)
    if not shapes:
        return {}
    if os.environ.get(PREFLIGHT_ENV, "1") in ("0", "false", "off"):
        return {preflight.TAG: "skipped"}
    error, tags = None, {}
    try:
        tags = preflight.run_preflight(shapes, device).as_params()
    except preflight.PreflightError as e:
        error = e
    failed = int(mesh.all_reduce_max([mesh.rank + 1 if error is not None else 0])[0]) - 1
    if error is not None:
        raise error
    if failed >= 0:
        raise preflight.PreflightError(f"FP8 GEMM preflight failed on rank {failed} (its error names the shape); "
                                       f"this rank's {len(shapes)} shapes passed on {device}; no FP8 step ran")
    return tags
