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
from fp8rl_core.engines.base import GenerationEngine, LogprobEngine, TrainBatch, TrainingEngine
from fp8rl_core.engines.kv_quant import KVScales
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
    # the training step whose weights the trainer holds (0: the initial weights); grpo_step counts it up
    # before its refit, a resume sets it to the restored step
    weights_step: int = 0
    _bf16_stale: bool = True

    def refit_generation(self, batch: TrainBatch | None = None, kv_scales: KVScales | None = None) -> None:
        """Refit the generation engine from the trainer's current weights (after every update).

        With an E4M3 KV cache (fp8.kv_cache e4m3) the refit names the weights' step, and under fp8.kv_scale
        trainer carries the trainer's KV scales for these weights, computed on `batch` (the step's batch;
        None: the calibration batch, kv_calibration_batch), unless `kv_scales` hands them in (a resume: the
        scales the checkpoint kept for these weights)."""
        if self.recipe.kv_cache != "e4m3":
            self.gen.refit(self.train.weights())
        elif self.recipe.kv_scale == "trainer":
            scales = kv_scales or self.train.kv_scales(batch if batch is not None else self.kv_calibration_batch(),
                                                       self.weights_step)
            self.gen.refit(self.train.weights(), step=self.weights_step, kv_scales=scales)
        else:  # first_forward: the engine computes them on its next prefill, unless a resume hands them back
            self.gen.refit(self.train.weights(), step=self.weights_step, kv_scales=kv_scales)
        self._bf16_stale = True

    def kv_calibration_batch(self) -> TrainBatch:
        """What the trainer computes KV scales on when no step's batch exists (the initial weights, a resume):
        rollout.prompts_per_step prompts drawn with their own RNG (the data stream is untouched), prompt
        tokens only, right-padded."""
        rng = random.Random(f"fp8rl-kv-calibration-{self.cfg.seed}-{self.weights_step}")
        prompts = [self.tokenizer.encode_prompt(ex.prompt)
                   for ex in self.task.sample_train(rng, self.cfg.rollout.prompts_per_step)]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, :len(p)], mask[i, :len(p)] = torch.tensor(p, dtype=torch.long), True
        return TrainBatch(ids, mask, torch.zeros_like(mask))

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
