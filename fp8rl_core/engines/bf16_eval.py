"""The engine-neutral BF16 evaluator (`val_accuracy_bf16_eval` under engines.generation vllm).

The native generation engine in BF16 (vLLM runs one sleep-mode engine per process on a GPU,
engines/vllm_gen.py; on a CPU, one engine keeps the evaluator the same for every arm), with vLLM's
colocation contract on top: it holds weights only from a refit (validation's, RunContext.bf16_engine, on
every rank) to `sleep(level=2)` (after its share of the evaluation), so a rollout never finds it on the
GPU; and it decodes at most `max_batch` sequences at once (validation's batch, config.val_batch_rows: at
most engines.vllm.max_num_seqs, so its KV cache is no larger than vLLM's pool; a larger call is refused),
whatever the world size.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fp8rl_core.engines.base import GenerationOutput, SamplingParams
from fp8rl_core.engines.native_gen import NativeGenerationEngine


class BF16Evaluator(NativeGenerationEngine):
    """GenerationEngine: NativeGenerationEngine's arguments (its recipe in BF16) and `max_batch`, the most
    sequences one generate call decodes. Its weights live from a refit to the next sleep(level=2)
    (NativeGenerationEngine.release)."""

    def __init__(self, *args: Any, max_batch: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_batch = max_batch

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> GenerationOutput:
        if len(prompts) > self.max_batch:
            raise ValueError(f"BF16Evaluator: {len(prompts)} sequences at once, above its max_batch "
                             f"{self.max_batch} (train.val_batch_size / engines.vllm.max_num_seqs)")
        return super().generate(prompts, sampling)

    def refit(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.release()  # the old copy goes before the new one is built: never two copies
        super().refit(weights)

    def sleep(self, level: int = 2) -> None:
        """level 2: release the weights (the next use must be a refit: generate raises before); 1: keep."""
        if level == 2:
            self.release()
