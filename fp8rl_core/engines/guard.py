"""The mismatch guard of one training step (`train.mismatch_guard`; off by default): skip the update, or
leave sequences out of the loss, when the generation/training mismatch or the gradient norm spikes.

Why: an fp8_e2e + token-IS run went from token_mult_prob_error 1.00-1.04 to 2,659 within 20 steps, with a
pre-clip gradient norm of 43 and then 53,651, and lost most of its reward and accuracy. Peers guard
against that: verl's rollout rejection sampling drops sequences whose train/rollout ratio leaves a band;
others skip updates on gradient spikes. This guard does either, on the study's own metric.

Per step (NativeTrainingEngine.train_step), with e = token_mult_prob_error of the step's batch (old
log-probs vs the generation engine's, over all ranks) and e_b the same per sequence b (metrics.
sequence_mult_prob_error, over b's response tokens):

    mask:  keep_b = (e_b <= max_mismatch) or b has no response token; the loss is the token-level mean over
           the kept sequences' tokens only, L = sum_{b kept, t valid} l_bt / sum_{b kept} n_b, so the kept
           tokens' terms have the scale they would have in a batch without the others (rejection sampling);
    skip:  no update when e > max_mismatch;
    both:  no update when max_grad_norm > 0 and the global pre-clip gradient norm > max_grad_norm, or (mask)
           when no sequence is kept (nothing to learn from).

Where e is known: on the two-pass path the old log-probs are given and e is measured before the forward;
on the reuse path (train.reuse_old_logprobs) the training forward's detached log-probs are the old ones,
so e is known after that forward and before its backward. Either way the step still runs its forward and
backward: a skipped step logs its loss and gradient norm (what it would have done), and the decision is
taken just before the optimizer step. A skipped step zeroes the gradients and leaves the weights, AdamW's
state, the engine's step count and the FP8 weight cache (keyed on the optimizer's step count and the
weights' versions) untouched.

Every rank takes the same decision: e and the kept counts are all-reduced (float64 sums), the gradient
norm is the global one (clip_grad_norm_ over FSDP2's DTensor shards returns the norm of the whole
gradient on every rank), and the verdict itself is all-reduced with max, so a rank skips exactly when
one does.
"""
from __future__ import annotations

import math

import torch

from fp8rl_core.algorithms.metrics import sequence_mult_prob_error, token_mult_prob_error_sum
from fp8rl_core.config import MismatchGuardSpec
from fp8rl_core.distributed.mesh import Mesh
from fp8rl_core.engines.base import TrainBatch
from fp8rl_core.tracking import M_GUARD_MASKED_FRACTION, M_GUARD_SKIPPED

M_GUARD_MISMATCH = "guard_mismatch"  # the step's token_mult_prob_error as the guard compared it
M_GUARD_SEQ_MAX = "guard_sequence_mismatch_max"  # the largest per-sequence token_mult_prob_error of the step
# why a step did not update (0/1 each; more than one may hold)
REASONS = {"guard_skip_mismatch": "token_mult_prob_error {mismatch:.6g} > max_mismatch {max_mismatch}",
           "guard_skip_grad_norm": "gradient norm {grad_norm:.6g} > max_grad_norm {max_grad_norm}",
           "guard_skip_all_masked": "every sequence is over max_mismatch {max_mismatch}: nothing left to learn from"}


class StepGuard:
    """What the guard saw and decided in one train_step (one per step; the engine drives it).

    observe(batch, mask) per micro-batch, once its old log-probs are known and before its loss: measures
    the mismatch and returns the loss mask (mask without the sequences over the band, action mask);
    reduce() once after the step's forwards: the global counts (collective); skips(grad_norm) before the
    optimizer step: the global verdict (collective); metrics() after it.

    step_mismatch: the rollout step's global token_mult_prob_error when the caller knows it and this batch
    is only part of the step (optim.micro_steps > 1); None: measured on this batch.
    """

    def __init__(self, spec: MismatchGuardSpec, mesh: Mesh, step_mismatch: float | None = None) -> None:
        self.spec, self.mesh, self.step_mismatch = spec, mesh, step_mismatch
        self._err_sum = self._err_n = 0.0  # float64 sum of exp(|old - gen|) over valid tokens, and their count
        self._rows = self._masked = self._tokens = self._kept_tokens = 0
        self._seq_max = 0.0
        self.mismatch = self.seq_max = math.nan
        self.masked_fraction, self.kept_tokens, self.tokens = 0.0, 0.0, 0.0
        self.reasons: dict[str, float] = dict.fromkeys(REASONS, 0.0)
        self.grad_norm = math.nan

    def observe(self, batch: TrainBatch, mask: torch.Tensor) -> torch.Tensor:
        """Bool[b, T] loss mask of this micro-batch: `mask` (its response tokens), without the rows whose
        e_b > max_mismatch under action mask. Needs batch.old_logprobs and batch.gen_logprobs (for a
        mismatch-only guard, gen_logprobs None leaves the mismatch unmeasured)."""
        self._rows += mask.shape[0]
        n = int(mask.sum())
        self._tokens += n
        if batch.gen_logprobs is None:
            if self.spec.action != "none":
                raise ValueError(f"train.mismatch_guard.action={self.spec.action}: the batch needs gen_logprobs "
                                 "(the generation engine's log-probs) to measure the mismatch")
            self._kept_tokens += n
            return mask
        old, gen = batch.old_logprobs.to(mask.device), batch.gen_logprobs.to(mask.device)
        total, count = token_mult_prob_error_sum(old, gen, mask)
        self._err_sum, self._err_n = self._err_sum + total, self._err_n + count
        per_seq = sequence_mult_prob_error(old, gen, mask)  # Float64[b]; nan where a row has no token
        has_tokens = mask.any(dim=-1)
        if bool(has_tokens.any()):
            # nan (a non-finite log-prob) counts as the largest: max() over a nan would hide the others
            self._seq_max = max(self._seq_max, float(per_seq[has_tokens].nan_to_num(nan=math.inf).max()))
        if self.spec.action != "mask":
            self._kept_tokens += n
            return mask
        # `<=` is False for nan: a sequence with a non-finite log-prob is left out, never kept by accident
        keep = ~has_tokens | (per_seq <= self.spec.max_mismatch)
        self._masked += int((~keep).sum())
        loss_mask = mask & keep[:, None].to(mask.device)
        self._kept_tokens += int(loss_mask.sum())
        return loss_mask

    def reduce(self) -> float:
        """Global counts over ranks (every rank calls it once, after the step's forwards). Returns the
        global number of tokens the loss keeps."""
        s = self.mesh.all_reduce_sum([self._err_sum, self._err_n, self._rows, self._masked, self._tokens,
                                      self._kept_tokens]).tolist()
        err_sum, err_n, rows, masked, tokens, kept = s
        self.seq_max = float(self.mesh.all_reduce_max([self._seq_max])[0]) if err_n else math.nan
        self.mismatch = self.step_mismatch if self.step_mismatch is not None else \
            (err_sum / err_n if err_n else math.nan)
        self.masked_fraction = masked / rows if rows else 0.0
        self.tokens, self.kept_tokens = tokens, kept
        return kept

    def skips(self, grad_norm: float) -> bool:
        """The global verdict before the optimizer step, from reduce()'s counts and the global pre-clip
        gradient norm; the same on every rank (all-reduced: a rank skips exactly when one does)."""
        s = self.spec
        self.grad_norm = grad_norm
        local = [s.action == "skip" and self.mismatch > s.max_mismatch,  # nan (no token): no verdict
                 s.max_grad_norm > 0 and grad_norm > s.max_grad_norm,
                 s.action == "mask" and self.tokens > 0 and self.kept_tokens == 0]
        verdict = self.mesh.all_reduce_max([float(x) for x in local]).tolist()
        self.reasons = dict(zip(REASONS, verdict))
        return any(verdict)

    def metrics(self) -> dict[str, float]:
        """guard_skipped (0/1), guard_masked_fraction (share of the step's sequences left out of the loss),
        guard_mismatch, guard_sequence_mismatch_max and the reasons guard_skip_* (0/1 each)."""
        return {M_GUARD_SKIPPED: float(any(self.reasons.values())), M_GUARD_MASKED_FRACTION: self.masked_fraction,
                M_GUARD_MISMATCH: self.mismatch, M_GUARD_SEQ_MAX: self.seq_max, **self.reasons}


def guard_note(metrics: dict[str, float], spec: MismatchGuardSpec) -> str | None:
    """One line for the run's log when the guard acted on a step (None when it did not): what it did and
    why, from the step's metrics (with optim.micro_steps > 1 they are the means over its optimizer steps)."""
    skipped, masked = metrics.get(M_GUARD_SKIPPED, 0.0), metrics.get(M_GUARD_MASKED_FRACTION, 0.0)
    if not skipped and not masked:
        return None
    values = {"mismatch": metrics.get(M_GUARD_MISMATCH, math.nan), "grad_norm": metrics.get("grad_norm", math.nan),
              "max_mismatch": spec.max_mismatch, "max_grad_norm": spec.max_grad_norm}
    parts = []
    if masked:
        parts.append(f"masked {masked:.1%} of the sequences (token_mult_prob_error per sequence > max_mismatch "
                     f"{spec.max_mismatch}; the largest {metrics.get(M_GUARD_SEQ_MAX, math.nan):.6g})")
    if skipped:
        why = "; ".join(text.format(**values) for key, text in REASONS.items() if metrics.get(key))
        share = "" if skipped == 1 else f" ({skipped:.0%} of its optimizer steps)"
        parts.append(f"skipped the update{share}: {why}")
    return "mismatch guard " + ", and ".join(parts)
