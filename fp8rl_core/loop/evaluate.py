"""Validation accuracy on the fixed held-out set, measured on the generation engine.

Two numbers, both on the recipe's own generation kernels (FP8 or BF16), as a deployed model answers:
- `val_accuracy`: pass@1 at the rollout temperature, i.e. mean reward of `val_samples` sampled
  answers per held-out prompt — what NeMo RL reports as validation accuracy, and what RL optimizes;
- `val_accuracy_greedy`: argmax decoding, one answer per prompt.

Batches, seeds and ranks (issue 31, M3). The work is a list of batches that does not depend on the world
size W: the greedy pass's P prompts in batches of c = `val_batch_rows(cfg)`, then the sampled pass's P x S
rows (each prompt repeated S times, consecutively) in batches of c. Batch k of the sampled pass is one
generate call seeded with VAL_SEED + k (vLLM: its per-request seeds drawn from that seed), so its samples do
not depend on which rank runs it nor on the batches before it. Batch i goes to rank i mod W; each rank sums
the rewards of its batches into a Float64[n_batches] vector (0 elsewhere), one all-reduce adds the vectors
(each entry comes from one rank: exact), and every rank sums each pass's entries in batch order:

    accuracy = (sum over the pass's batches k of sum_{rows of k} reward) / rows of the pass

So every W computes the same metrics, bit for bit, on engines whose numerics do not depend on the rank
(the native ones), and no rank decodes more than ceil(n_batches / W) batches. Validation restores the
engine's sampling stream afterwards, so it neither perturbs training nor adds sampling noise between
validation points. With one batch per pass (the default 512 rows; the default 128 prompts x 4 samples),
the numbers are those of the single-rank code before the split.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.engines.base import GenerationEngine, SamplingParams
from fp8rl_core.tracking import M_VAL_ACC

VAL_SEED = 20_240_917
GREEDY = "val_accuracy_greedy"


@dataclass(frozen=True)
class ValBatch:
    """One generate call of validation: `examples` of the pass `metric`, the k-th batch of that pass."""

    metric: str  # GREEDY or M_VAL_ACC: the pass it counts towards
    k: int  # index within the pass (its sampling seed is VAL_SEED + k)
    examples: tuple


def val_batches(examples: list, samples: int, rows: int, greedy: bool = True) -> list[ValBatch]:
    """The validation work, the same at every world size: the greedy pass (when `greedy` or samples == 0)
    in batches of `rows` prompts, then the sampled pass (samples > 0: each prompt repeated `samples` times)
    in batches of `rows`."""
    passes = []
    if greedy or samples == 0:
        passes.append((GREEDY, list(examples)))
    if samples > 0:
        passes.append((M_VAL_ACC, [ex for ex in examples for _ in range(samples)]))
    return [ValBatch(metric, k, tuple(todo[start:start + rows]))
            for metric, todo in passes for k, start in enumerate(range(0, len(todo), rows))]


def _reward_sum(gen: GenerationEngine, tokenizer: Any, task: Any, examples: Any, sampling: SamplingParams) -> float:
    """Sum of task rewards of one generate call on `examples` (one answer each)."""
    out = gen.generate([tokenizer.encode_prompt(ex.prompt) for ex in examples], sampling)
    lengths = out.response_mask.sum(dim=1).tolist()
    total = 0.0
    for i, ex in enumerate(examples):
        total += task.reward(ex, tokenizer.decode(out.response_ids[i, :lengths[i]].tolist()))
    return total


def _batch_params(batch: ValBatch, sampling: SamplingParams) -> SamplingParams:
    """Greedy: argmax, no stream used; sampled: the pass's sampling seeded with VAL_SEED + k."""
    if batch.metric == GREEDY:
        return SamplingParams(max_new_tokens=sampling.max_new_tokens, greedy=True)
    return replace(sampling, seed=VAL_SEED + batch.k)


def greedy_accuracy(gen: GenerationEngine, tokenizer: Any, task: Any, examples: list, max_new_tokens: int,
                    batch_size: int = 512) -> float:
    """Mean exact-match reward of argmax decoding on `examples` (no sampling stream is used), on this rank."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    total = sum(_reward_sum(gen, tokenizer, task, b.examples, greedy)
                for b in val_batches(examples, 0, batch_size))
    return total / max(len(examples), 1)


def validation_metrics(gen: GenerationEngine, tokenizer: Any, task: Any, sampling: SamplingParams,
                       samples: int, batch_size: int = 512, greedy: bool = True, mesh: Mesh = SINGLE
                       ) -> dict[str, float]:
    """{'val_accuracy': sampled pass@1 over `samples` draws per prompt, 'val_accuracy_greedy': ...}, the
    same on every rank. Collective at W > 1 (one all-reduce): this rank generates batches rank, rank + W,
    ... of val_batches (module docstring). greedy=False: val_accuracy alone (no greedy pass unless samples
    is 0, when it is val_accuracy)."""
    batches = val_batches(task.val_examples, samples, batch_size, greedy)
    saved = gen.generator.get_state()
    try:
        sums = [0.0] * len(batches)
        for i in range(mesh.rank, len(batches), mesh.world_size):
            sums[i] = _reward_sum(gen, tokenizer, task, batches[i].examples, _batch_params(batches[i], sampling))
    finally:
        gen.generator.set_state(saved)
    if mesh.distributed:
        sums = mesh.all_reduce_sum(sums).tolist()
    out = {}
    for metric in dict.fromkeys(b.metric for b in batches):
        mine = [(s, len(b.examples)) for s, b in zip(sums, batches) if b.metric == metric]
        out[metric] = sum(s for s, _ in mine) / max(sum(n for _, n in mine), 1)
    if M_VAL_ACC not in out:
        out[M_VAL_ACC] = out.get(GREEDY, 0.0)
    return out if greedy else {M_VAL_ACC: out[M_VAL_ACC]}
