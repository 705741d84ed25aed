"""The run's setup: what one rank resolves once from its RunConfig, before anything is built.

loop/builder.py `resolve_setup` is the one place where the recipe (config.recipe_of), the compute dtype, the
BF16 path, the device, the rank's sampling seed, the tokenizer and the task are decided; every builder
function and the warm start (loop/warmstart.py) take the frozen result, so that none re-resolves them.
Below the setup only plain values flow: the engines take `upcast_bf16` (a bool), not the config knob.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8rl_core.config import RunConfig
from fp8rl_core.config.recipe import Recipe
from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.model.tokenizer import Tokenizer
from fp8rl_core.tasks import Task


@dataclass(frozen=True)
class RunSetup:
    cfg: RunConfig
    recipe: Recipe  # what each engine quantizes (config.recipe_of)
    compute_dtype: torch.dtype  # model.dtype: torch.bfloat16 or torch.float32
    bf16_path: str  # the BF16 path on `device`: "native" | "emulated" | "none" (fp32: nothing in BF16)
    warmstart_bf16_path: str  # the same on the CPU, where the warm start trains (loop/warmstart.py)
    device: str  # "cpu", "cuda" or "cuda:<local rank>"
    tokenizer: Tokenizer
    task: Task
    mesh: Mesh = SINGLE  # this process's rank and world size (fp8rl_core/distributed)
    rank_seed: int = 0  # this rank's sampling seed (builder.rank_seed: the run's seed on rank 0)

    @property
    def upcast_bf16(self) -> bool:
        """BF16 matrix products run in FP32 on their upcast BF16 operands, rounded once (model/bf16.py)."""
        return self.bf16_path == "emulated"

    @property
    def warmstart_upcast_bf16(self) -> bool:
        return self.warmstart_bf16_path == "emulated"
