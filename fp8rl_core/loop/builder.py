"""Build everything one run needs from its RunConfig: tokenizer, task, initial weights, both engines.

Backends are chosen here by name (`engines.generation`, `engines.training`); the optional GPU ones
(vLLM, Megatron-Core) are imported only when asked for, so a CPU install never needs them.

Ranks (fp8rl_core/distributed): the process group is joined here from the launcher's environment
(torchrun, multi-task SLURM); world size 1 builds exactly the single-process context. Each rank gets
its own generation engine whose sampling seed is `rank_seed(seed, rank)` (rank 0: the run's seed).
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.config import RunConfig, recipe_of
from fp8rl_core.config.recipe import Recipe
from fp8rl_core.config.schema import ConfigError
from fp8rl_core.distributed import init_distributed
from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.engines.native_train import NativeTrainingEngine, ReferencePolicy
from fp8rl_core.fp8.gemm import select_executor
from fp8rl_core.loop.context import RunContext
from fp8rl_core.loop.warmstart import warm_start
from fp8rl_core.model import bf16, load_pretrained
from fp8rl_core.model.hf_io import read_model_config
from fp8rl_core.model.tokenizer import Tokenizer, char_tokenizer
from fp8rl_core.tasks import make_task
from fp8rl_core.tracking import TAG_BF16_COMPUTE, TAG_CPU_FLAGS, TAG_FP8_GEMM


def resolve_device(cfg: RunConfig) -> str:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: 'cuda' requested but torch.cuda.is_available() is False; use device=cpu or auto")
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def compute_dtype(cfg: RunConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32


def bf16_path(cfg: RunConfig, device: str) -> str:
    """The BF16 path that runs: "native" or "emulated" (model.bf16_compute resolved on this machine;
    fp8rl_core/model/bf16.py), or "none" when model.dtype is fp32 (nothing runs in BF16)."""
    return bf16.bf16_path(cfg.model.dtype, cfg.model.bf16_compute, device)


def emulates_bf16(cfg: RunConfig, device: str) -> bool:
    return bf16_path(cfg, device) == "emulated"


def numerics_tags(cfg: RunConfig, device: str) -> dict[str, str]:
    """What computed this attempt, as MLflow tags (not params: a resume on another node may differ):
    the BF16 path, the CPU flags that decided it, and the FP8 GEMM executor."""

    return {TAG_BF16_COMPUTE: bf16_path(cfg, device), TAG_CPU_FLAGS: bf16.recorded_flags() or "-",
            TAG_FP8_GEMM: select_executor(device)}


def load_tokenizer(cfg: RunConfig) -> Any:
    if cfg.model.path and (Path(cfg.model.path) / "tokenizer.json").exists():
        return Tokenizer.from_file(Path(cfg.model.path) / "tokenizer.json")
    return char_tokenizer()


def initial_checkpoint(cfg: RunConfig, tokenizer: Any, task: Any, progress: bool) -> Path:
    """The weights every cell starts from: the user's checkpoint, else the cached warm start."""

    if cfg.model.path:
        return Path(cfg.model.path)
    return warm_start(cfg, tokenizer, task, progress=progress)


def rank_seed(seed: int, rank: int) -> int:
    """Sampling seed of rank `rank`'s generation engine: the run's seed on rank 0, else a stable
    63-bit hash of (seed, rank), so that ranks draw independent streams and a rerun draws the same."""
    return seed if rank == 0 else random.Random(f"fp8rl-gen-{seed}-rank{rank}").getrandbits(63)


def check_data_parallel(cfg: RunConfig, mesh: Mesh) -> None:
    """P prompts split by whole GRPO groups over the ranks: P must be a multiple of the world size."""
    P, W = cfg.rollout.prompts_per_step, mesh.world_size
    if P % W:
        valid = ", ".join(str(W * k) for k in range(1, 4)) + ", ..."
        raise ConfigError("rollout.prompts_per_step", f"{P} prompts cannot be split by whole GRPO groups over "
                          f"{W} data-parallel ranks (world size {W})", f"multiples of {W}: {valid}")


def build_training_engine(cfg: RunConfig, path: Path, device: str, mesh: Mesh = SINGLE) -> Any:
    if cfg.engines.training != "native":
        from fp8rl_core.engines.megatron_train import MegatronTrainingEngine  # optional, needs CUDA

        return MegatronTrainingEngine(path, recipe=recipe_of(cfg), megatron=cfg.engines.megatron, loss=cfg.loss,
                                      optim=cfg.optim, temperature=cfg.rollout.temperature,
                                      compute_dtype=compute_dtype(cfg), seed=cfg.seed)

    model = load_pretrained(path, dtype=torch.float32).to(device)  # FP32 master weights
    return NativeTrainingEngine(model, recipe=recipe_of(cfg), loss=cfg.loss, optim=cfg.optim,
                                temperature=cfg.rollout.temperature,
                                compute_dtype=compute_dtype(cfg), mesh=mesh,
                                micro_batch_size=cfg.train.micro_batch_size,
                                logprob_batch_size=cfg.train.logprob_batch_size,
                                cpu_offload=cfg.parallel.cpu_offload,
                                activation_checkpointing=cfg.parallel.activation_checkpointing,
                                grad_reduce=cfg.parallel.grad_reduce,
                                reshard_after_forward=cfg.parallel.reshard_after_forward,
                                emulate_bf16=emulates_bf16(cfg, device))


def build_reference(cfg: RunConfig, path: Path, device: str, mesh: Mesh = SINGLE) -> Any:
    """The frozen reference policy of the KL term (kl_coef > 0): compute-dtype weights, no optimizer."""
    if cfg.engines.training != "native":
        return build_training_engine(cfg, path, device, mesh)

    dtype = compute_dtype(cfg)
    return ReferencePolicy(load_pretrained(path, dtype=dtype), device=device,
                           recipe=recipe_of(cfg),
                           temperature=cfg.rollout.temperature, compute_dtype=dtype, mesh=mesh,
                           logprob_batch_size=cfg.train.logprob_batch_size, cpu_offload=cfg.parallel.cpu_offload,
                           emulate_bf16=emulates_bf16(cfg, device))


def build_generation_engine(cfg: RunConfig, model_config: Any, device: str, rank: int = 0,
                            recipe: Recipe | None = None, output_dir: str | None = None) -> Any:
    """The generation engine of `recipe` (None: the run's, config.recipe_of) for this rank."""
    recipe = recipe or recipe_of(cfg)
    if cfg.engines.generation != "native":
        return vllm_engine(cfg, model_config, recipe, output_dir or cfg.output_dir)

    return NativeGenerationEngine(model_config, recipe=recipe, dtype=compute_dtype(cfg), device=device,
                                  seed=rank_seed(cfg.seed, rank), emulate_bf16=emulates_bf16(cfg, device))


def vllm_engine(cfg: RunConfig, model_config: Any, recipe: Recipe | None = None, output_dir: str | None = None,
                task: Any = None) -> Any:
    """vLLM generation engine (optional, needs CUDA) of the run, its tokenizer and task handed in."""
    from fp8rl_core.engines.vllm_gen import VllmGenerationEngine

    return VllmGenerationEngine(model_config, recipe=recipe or recipe_of(cfg), dtype=compute_dtype(cfg),
                                vllm=cfg.engines.vllm, seed=cfg.seed, max_new_tokens=cfg.rollout.max_new_tokens,
                                output_dir=output_dir or cfg.output_dir, tokenizer=load_tokenizer(cfg),
                                task=task if task is not None else make_task(cfg.task))


def build_bf16_generation_engine(cfg: RunConfig, path: Path, model_config: Any, device: str, rank: int = 0) -> Any:
    """The arm's generation backend run in BF16 (the bf16 recipe's engine) beside an FP8 one, or None when
    the arm generates in BF16 already: the engine-neutral evaluation (val_accuracy_bf16_eval) and
    fp8_gen's matched-kernel replay. vLLM: a second engine, started asleep like the first."""
    recipe = recipe_of(cfg)
    if not recipe.fp8_generation:
        return None
    gen = build_generation_engine(cfg, model_config, device, rank, recipe=recipe.in_bf16(),
                                  output_dir=str(Path(cfg.output_dir) / "bf16_engine"))
    if cfg.engines.generation == "vllm":
        gen.start(path)
    return gen


def build_trainers(cfg: RunConfig, path: Path, device: str, mesh: Mesh) -> tuple[Any, Any]:
    """(training engine, reference policy or None: kl_coef 0) on the weights of `path`."""
    train = build_training_engine(cfg, path, device, mesh)
    return train, build_reference(cfg, path, device, mesh) if cfg.loss.kl_coef > 0 else None


def build_engines(cfg: RunConfig, path: Path, model_config: Any, device: str, mesh: Mesh
                  ) -> tuple[Any, Any, Any, Any]:
    """(generation, BF16 generation or None, training, reference or None) engines; the caller refits the
    generation engines from the trainer.

    vLLM starts first, on `path`, and sleeps (the BF16 evaluation engine of an FP8 arm likewise): their
    start-up free-memory checks must run before the trainer's FP32 master weights take the GPU
    (VllmGenerationEngine.start). Native: the trainers, then the generation engines."""
    rank = mesh.rank
    if cfg.engines.generation == "vllm":
        gen = build_generation_engine(cfg, model_config, device, rank)
        gen.start(path)
        bf16_gen = build_bf16_generation_engine(cfg, path, model_config, device, rank)
        return (gen, bf16_gen, *build_trainers(cfg, path, device, mesh))
    train, ref = build_trainers(cfg, path, device, mesh)
    return (build_generation_engine(cfg, model_config, device, rank),
            build_bf16_generation_engine(cfg, path, model_config, device, rank), train, ref)


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
    tokenizer = load_tokenizer(cfg)
    task = make_task(cfg.task)
    # the warm-start cache is file-locked: one rank trains it, the others wait and read it
    path = initial_checkpoint(cfg, tokenizer, task, progress and mesh.is_rank0)

    model_config = read_model_config(path)  # config.json + generation_config.json's EOS ids (turn ends)
    gen, bf16_gen, train, ref = build_engines(cfg, path, model_config, device, mesh)
    ctx = RunContext(cfg=cfg, tokenizer=tokenizer, task=task, gen=gen, train=train, ref=ref,
                     data_rng=random.Random(f"fp8rl-data-{cfg.seed}"),
                     shuffle=torch.Generator().manual_seed(cfg.seed), mesh=mesh, bf16_gen=bf16_gen,
                     recipe=recipe_of(cfg), numerics=numerics_tags(cfg, device))
    ctx.refit_generation()
    return ctx
