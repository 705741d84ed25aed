"""Build everything one run needs from its RunConfig: tokenizer, task, initial weights, both engines.

Backends are chosen here by name (`engines.generation`, `engines.training`); the optional GPU ones
(vLLM, Megatron-Core) are imported only when asked for, so a CPU install never needs them.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from fp8rl_core.config import RunConfig
from fp8rl_core.grpo_step import RunContext
from fp8rl_core.recipes import get_recipe


def resolve_device(cfg: RunConfig) -> str:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device: 'cuda' requested but torch.cuda.is_available() is False; use device=cpu or auto")
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def compute_dtype(cfg: RunConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.model.dtype == "bf16" else torch.float32


def load_tokenizer(cfg: RunConfig) -> Any:
    from fp8rl_core.model.tokenizer import Tokenizer, char_tokenizer

    if cfg.model.path and (Path(cfg.model.path) / "tokenizer.json").exists():
        return Tokenizer.from_file(Path(cfg.model.path) / "tokenizer.json")
    return char_tokenizer()


def initial_checkpoint(cfg: RunConfig, tokenizer: Any, task: Any, progress: bool) -> Path:
    """The weights every cell starts from: the user's checkpoint, else the cached warm start."""
    from fp8rl_core.warmstart import warm_start

    if cfg.model.path:
        return Path(cfg.model.path)
    return warm_start(cfg, tokenizer, task, progress=progress)


def build_training_engine(cfg: RunConfig, path: Path, device: str) -> Any:
    if cfg.engines.training != "native":
        from fp8rl_core.engines.megatron_train import MegatronTrainingEngine  # optional, needs CUDA

        return MegatronTrainingEngine(cfg, path)
    from fp8rl_core.engines.native_train import NativeTrainingEngine
    from fp8rl_core.model import load_pretrained

    model = load_pretrained(path, dtype=torch.float32).to(device)  # FP32 master weights
    return NativeTrainingEngine(model, fp8_training=get_recipe(cfg.recipe).fp8_training, fp8_spec=cfg.fp8,
                                loss=cfg.loss, optim=cfg.optim, temperature=cfg.rollout.temperature,
                                compute_dtype=compute_dtype(cfg))


def build_generation_engine(cfg: RunConfig, model_config: Any, device: str) -> Any:
    if cfg.engines.generation != "native":
        from fp8rl_core.engines.vllm_gen import VllmGenerationEngine  # optional, needs CUDA

        return VllmGenerationEngine(cfg, model_config)
    from fp8rl_core.engines.native_gen import NativeGenerationEngine

    return NativeGenerationEngine(model_config, fp8=get_recipe(cfg.recipe).fp8_generation, fp8_spec=cfg.fp8,
                                  dtype=compute_dtype(cfg), device=device, seed=cfg.seed)


def build_context(cfg: RunConfig, progress: bool = True) -> RunContext:
    from fp8rl_core.model.config import ModelConfig
    from fp8rl_core.tasks import make_task

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg)
    tokenizer = load_tokenizer(cfg)
    task = make_task(cfg.task)
    path = initial_checkpoint(cfg, tokenizer, task, progress)
    import json

    model_config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    train = build_training_engine(cfg, path, device)
    ref = build_training_engine(cfg, path, device) if cfg.loss.kl_coef > 0 else None
    gen = build_generation_engine(cfg, model_config, device)
    gen.refit(train.weights())
    return RunContext(cfg=cfg, tokenizer=tokenizer, task=task, gen=gen, train=train, ref=ref,
                      data_rng=random.Random(f"fp8rl-data-{cfg.seed}"),
                      shuffle=torch.Generator().manual_seed(cfg.seed))
