"""What one rank of a run holds while it runs: config, tokenizer, task, engines, RNG streams, mesh.

Built once by loop/builder.py and handed to every part of the loop (step, evaluate, run, diagnostics),
so that no part rebuilds or re-resolves what the builder decided: the recipe object, tokenizer and task
come from the run's setup (loop/setup.py, resolved once), the engines are constructed once, and the BF16
evaluation engine is refit lazily.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from fp8rl_core.config import RunConfig
from fp8rl_core.config.recipe import BF16, Recipe
from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.engines.base import GenerationEngine, LogprobEngine, TrainingEngine
from fp8rl_core.model.tokenizer import Tokenizer
from fp8rl_core.tasks import Task


@dataclass
class RunContext:
    cfg: RunConfig
    tokenizer: Tokenizer
    task: Task
    gen: GenerationEngine
    train: TrainingEngine
    ref: LogprobEngine | None  # frozen reference policy for the KL term (kl_coef > 0)
    data_rng: random.Random  # prompt sampling, the same on every rank; its state is checkpointed
    shuffle: torch.Generator  # minibatch order; its state is checkpointed
    mesh: Mesh = SINGLE  # this process's rank and world size (fp8rl_core/distributed)
    # a BF16 generation engine beside the arm's: the engine-neutral evaluation (val_accuracy_bf16_eval) and,
    # for fp8_gen, the matched-kernel replay at the trainer's precision. Native generation: None for a recipe
    # that generates in BF16 (its own engine serves); vLLM: the native BF16 evaluator for every recipe
    # (engines/bf16_eval.py). Refit lazily, only when used (bf16_engine)
    bf16_gen: GenerationEngine | None = None
    recipe: Recipe = BF16  # the run's recipe, resolved once (config.recipe_of): what each engine quantizes
    numerics: dict[str, str] = field(default_factory=dict)  # what ran: BF16 path, CPU flags (MLflow tags)
    _bf16_stale: bool = True

    def refit_generation(self) -> None:
        """Refit the generation engine from the trainer's current weights (after every update)."""
        self.gen.refit(self.train.weights())
        self._bf16_stale = True

    def bf16_engine(self) -> GenerationEngine:
        """The BF16 generation engine on the trainer's current weights (the arm's own if it is BF16)."""
        if self.bf16_gen is None:
            return self.gen
        if self._bf16_stale:
            self.bf16_gen.refit(self.train.weights())
            self._bf16_stale = False
        return self.bf16_gen

    def replay_engine(self) -> GenerationEngine:
        """engines.kernels matched: the generation engine at the trainer's precision (its own engine when
        both sides quantize alike: bf16, fp8_e2e; the BF16 engine for fp8_gen's BF16 trainer)."""
        same = self.recipe.fp8_generation == self.recipe.fp8_training
        return self.gen if same else self.bf16_engine()
