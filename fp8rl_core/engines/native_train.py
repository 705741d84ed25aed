"""The native training engine: full-sequence forward/backward with autograd, AdamW on FP32 masters.

Plays Megatron-Core's part (docs/design.md "The two engines"): training-style kernels (fp8rl_core/model/
layers.py), parameters and optimizer state in FP32, compute in BF16 through `torch.autocast` (BF16
recipe) or through `Fp8Linear` forward and backward for `fp8_e2e` (the linear layers except lm_head
and the recipe's kept blocks; embeddings, norms, attention and the head stay BF16 under autocast).

Log-probabilities: lp[b, t] = log_softmax(logits[b, t-1] / temperature)[input_ids[b, t]], in FP32,
0 at t = 0 and wherever response_mask is False: the distribution the generation engine samples from
(before top-k/top-p), so that the two engines' numbers are comparable token by token.

Padding-free (`train.padding_free`, model/packing.py): the log-prob and training passes run the model on
the real tokens of the batch only ([1, N] instead of [B, T]; attention per sequence) and scatter the
log-probs back to [B, T]: the same values up to GEMM summation order (FP8: up to which tokens share a
wgrad block), for ~25% fewer FLOPs at the study's lengths (docs/design.md "Padding-free training passes").

Scale-out (docs/design.md "Scale-out"): with a Mesh of world size > 1 the model is sharded with FSDP2 and
the optimizer holds local shards; a step's loss is the token-level mean over the GLOBAL batch, each
micro-batch contributing (its token sum) / (the global count of valid tokens), so that micro-batches
and ranks add up to the unsplit single-process step (within FP32 rounding). Metrics are global and
token-weighted. World size 1 without micro-batches runs exactly the single-process code path.
"""
from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F

from fp8rl_core.algorithms import grpo
from fp8rl_core.config import LossSpec, MismatchGuardSpec, OptimSpec
from fp8rl_core.config.recipe import BF16, Recipe
from fp8rl_core.distributed import parallel
from fp8rl_core.distributed.mesh import SINGLE, Mesh
from fp8rl_core.distributed.parallel import GatheredWeights, shard_model
from fp8rl_core.engines.base import Importance, TrainBatch, TrainResult
from fp8rl_core.engines.guard import StepGuard
from fp8rl_core.engines.kv_quant import KVScales, trainer_scales
from fp8rl_core.model.bf16 import upcast_bf16_matmuls
from fp8rl_core.model.fp8_policy import apply_fp8
from fp8rl_core.model.layers import Attention
from fp8rl_core.model.llama import CausalLM
from fp8rl_core.model.packing import Packed, pack


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32[B, T] log p(input_ids[:, t] | <t) from logits [B, T, V] (position t-1 predicts t).

    Column 0 (nothing predicts it) is 0. With `with_entropy`, also the per-position entropy
    H[b, t] = -sum_v p log p of the distribution that predicted token t (no grad), else None.
    """
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, T-1, V]
    lp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = F.pad(-(logp.exp() * logp).sum(-1), (1, 0))
    return F.pad(lp, (1, 0)), entropy


def packed_token_logprobs(logits: torch.Tensor, ids: torch.Tensor, packed: Packed, temperature: float = 1.0,
                          with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`token_logprobs` of a padding-free forward: logits [N, V] and ids Long[N] of the packed real tokens
    -> Float32[B, T] (and the entropy [B, T] with `with_entropy`) at the padded batch's places.

    Packed token i predicts token i + 1 when that one continues its sequence (position > 0); a sequence's
    first token, and every padding place, get 0 (as column 0 of the padded path; padding is masked anyway).
    """
    logp = torch.log_softmax(logits[:-1].float() / temperature, dim=-1)  # [N-1, V]
    follows = packed.positions[1:] > 0  # token i + 1 is in token i's sequence
    lp = torch.where(follows, logp.gather(-1, ids[1:, None]).squeeze(-1), torch.zeros((), device=logp.device))
    entropy = None
    if with_entropy:
        with torch.no_grad():
            h = torch.where(follows, -(logp.exp() * logp).sum(-1), torch.zeros((), device=logp.device))
            entropy = packed.put(F.pad(h, (1, 0)))
    return packed.put(F.pad(lp, (1, 0))), entropy


def model_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   temperature: float, autocast: AbstractContextManager, with_entropy: bool = False,
                   padding_free: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Float32[B, T] log-probs (and entropy) of input_ids [B, T] (on the model's device) under `model`,
    padded or padding-free; the model runs under `autocast`, the log-softmax outside it in FP32. A batch
    without padding takes the padded path (the same rows in the same order: the same numerics, no copies)."""
    if not padding_free or attention_mask is None or bool(attention_mask.all()):
        with autocast:
            logits = model(input_ids, attention_mask)
        return token_logprobs(logits, input_ids, temperature, with_entropy)
    packed = pack(attention_mask)
    ids = packed.take(input_ids)
    with autocast:
        logits = model(ids[None], None, packed=packed)[0]
    return packed_token_logprobs(logits, ids, packed, temperature, with_entropy)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(torch.where(mask, x, torch.zeros_like(x)).sum()) / n if n else 0.0


def row_chunks(batch_size: int, chunk: int) -> list[slice]:
    """Row slices of at most `chunk` sequences covering [0, batch_size) (chunk <= 0: one slice)."""
    if chunk <= 0 or chunk >= batch_size:
        return [slice(0, batch_size)]
    return [slice(i, min(i + chunk, batch_size)) for i in range(0, batch_size, chunk)]


def _rows(batch: TrainBatch, rows: slice) -> TrainBatch:
    """The sub-batch of a row slice (views, no copy)."""
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return TrainBatch(*(pick(getattr(batch, f)) for f in batch.__dataclass_fields__))


# Metrics of grpo.policy_loss: "share" ones are already divided by the global token count (they add up
# over micro-batches and ranks); "mean" ones are per-token means of their micro-batch (re-weighted by its
# token count); ratio_max takes the max.
_SHARE, _MEAN = ("loss", "pg_loss", "kl"), ("clip_fraction", "ratio_mean", "entropy")

GRAD_REDUCE = ("micro_batch", "step")  # when sharded gradients are reduce-scattered (see grad_reduce)


class NativeTrainingEngine:
    """TrainingEngine (fp8rl_core/engines/base.py) on our CausalLM.

    model:        the policy with FP32 parameters (the master weights), on the device to train on;
    recipe:       what it quantizes (fp8rl_core/config/recipe.py): with a `training` side its linear layers
                  (but the kept blocks and lm_head) are swapped for Fp8Linear in place.
    compute_dtype: torch.bfloat16 (autocast) or torch.float32 (no autocast; for tests).
    upcast_bf16:  the BF16 products (plain linears, lm_head, attention) run in FP32 on their upcast
                  BF16 operands and round to BF16 (the emulated BF16 path; model/bf16.py).
    recipe.training.quantize_from: "bf16" quantizes the BF16 rounding of each master weight (what the
                  generation engine quantizes), "master" the FP32 master itself.
    optim:        AdamW(lr, betas, eps, weight_decay on every parameter), grad_clip (<= 0: off).
    mesh:         ranks to shard over with FSDP2 (None / world size 1: unsharded, no collectives).
    micro_batch_size / logprob_batch_size: sequences per forward(/backward) of train_step / logprobs
                  (0: the whole batch); cpu_offload: FSDP2 CPUOffloadPolicy; activation_checkpointing:
                  recompute each block in backward.
    grad_reduce:  sharded only: "micro_batch" reduce-scatters after every micro-batch's backward
                  (gradients stay sharded); "step" only after the last one (one collective per step,
                  but each rank accumulates the full unsharded gradient in between).
    reshard_after_forward: sharded only: False keeps each block's gathered weights from the step's
                  first forward to its last backward (FSDP2's set_reshard_after_backward between
                  micro-batches): one all-gather per step instead of two per micro-batch, for a full
                  weight copy per rank (which every forward reaches anyway).
    padding_free: every forward (log-prob, training and SFT passes) runs on the batch's real tokens only
                  (model/packing.py; `train.padding_free`).
    guard:        `train.mismatch_guard` (engines/guard.py): skip the update or mask sequences on a mismatch
                  or gradient-norm spike; None or a guard that cannot act: off (no extra work, no metrics).
    One `train_step` is one optimizer step; the caller splits a rollout batch into micro-steps.
    """

    reports_old_logprobs = True  # train_step returns the old log-probs / IS weights it used (TrainResult)

    def __init__(self, model: CausalLM, *, recipe: Recipe = BF16, loss: LossSpec | None = None,
                 optim: OptimSpec | None = None, temperature: float = 1.0,
                 compute_dtype: torch.dtype = torch.bfloat16, mesh: Mesh | None = None, micro_batch_size: int = 0,
                 logprob_batch_size: int = 0, cpu_offload: bool = False,
                 activation_checkpointing: bool = False, grad_reduce: str = "micro_batch",
                 reshard_after_forward: bool = True, upcast_bf16: bool = False, padding_free: bool = False,
                 guard: MismatchGuardSpec | None = None, mixed_precision: str = "none") -> None:
        if grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"grad_reduce: {grad_reduce!r} not allowed; valid: {', '.join(GRAD_REDUCE)}")
        bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"model: master weights must be float32; {bad[0]} is {model.get_parameter(bad[0]).dtype}")
        if compute_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"compute_dtype: {compute_dtype} not supported; valid: torch.bfloat16, torch.float32")
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        self.model, self.temperature, self.compute_dtype = model, float(temperature), compute_dtype
        self.padding_free = bool(padding_free)
        self.guard_spec = guard if guard is not None and guard.enabled else None
        self.loss_spec, self.optim_spec = loss or LossSpec(), optim or OptimSpec()
        self.fp8_modules = apply_fp8(model, recipe, compute_dtype) if recipe.fp8_training else []
        self.upcast_bf16 = bool(upcast_bf16) and compute_dtype == torch.bfloat16
        if self.upcast_bf16:
            upcast_bf16_matmuls(model)
        self.mesh = mesh or SINGLE
        self.micro_batch_size, self.logprob_batch_size = int(micro_batch_size), int(logprob_batch_size)
        self._device = next(model.parameters()).device  # the compute device (shards may be offloaded)
        self.grad_reduce, self.reshard_after_forward = grad_reduce, bool(reshard_after_forward)
        _parallelize(model, self.mesh, cpu_offload, activation_checkpointing, reshard_after_forward, mixed_precision)
        o = self.optim_spec
        self.params = list(model.parameters())  # tied weights appear once; DTensor shards when sharded
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.step = 0

    @property
    def device(self) -> torch.device:
        return self._device

    def _autocast(self) -> AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.compute_dtype == torch.bfloat16)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        mask = None if attention_mask is None else attention_mask.to(self.device)
        return model_logprobs(self.model, input_ids.to(self.device), mask, temperature, self._autocast(),
                              with_entropy, self.padding_free)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Float32[B, T] log-probs of batch.input_ids under the current weights; 0 off response_mask.
        Runs `logprob_batch_size` sequences per forward (rows are independent: same values)."""
        return _chunked_logprobs(self._forward, batch, self.temperature, self.logprob_batch_size)

    @torch.no_grad()
    def kv_scales(self, batch: TrainBatch, step: int) -> KVScales:
        """The generation engine's E4M3 KV-cache scales for the current weights (fp8.kv_scale trainer, NeMo RL's
        design): one forward per micro-batch (`micro_batch_size` rows) of `batch`, no gradient, as a training
        forward runs; per forward and layer the amax of post-RoPE K and of V over the real tokens (read by
        each Attention's kv_observer: the forward's numerics are untouched); then kv_quant.trainer_scales
        (99.9th percentile over forwards x 1.05 / 448, max over ranks). `step`: the step of these weights."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        k_amax, v_amax, real = [], [], [None]

        def observer(layer: int):
            def observe(k: torch.Tensor, v: torch.Tensor) -> None:
                ka, va = k.abs().amax(dim=(1, 3)).float(), v.abs().amax(dim=(1, 3)).float()  # [B, T]
                if real[0] is not None and ka.shape == real[0].shape:  # padded rows: real tokens only
                    ka, va = ka.masked_fill(~real[0], 0.0), va.masked_fill(~real[0], 0.0)
                k_amax[-1][layer], v_amax[-1][layer] = ka.max(), va.max()
            return observe

        for i, attn in enumerate(layers):
            attn.kv_observer = observer(i)
        try:
            for rows in row_chunks(batch.input_ids.shape[0], self.micro_batch_size):
                sub = _rows(batch, rows)
                k_amax.append([None] * len(layers))
                v_amax.append([None] * len(layers))
                real[0] = None if sub.attention_mask is None else sub.attention_mask.to(self.device).bool()
                self._forward(sub.input_ids, sub.attention_mask, self.temperature)
        finally:
            for attn in layers:
                attn.kv_observer = None
        stack = lambda a: torch.stack([torch.stack(f) for f in a]).cpu()  # noqa: E731  [F, L]
        return trainer_scales(stack(k_amax), stack(v_amax), step, self.mesh)

    def train_step(self, batch: TrainBatch, importance: Importance | None = None,
                   step_mismatch: float | None = None) -> TrainResult:
        """One AdamW step on grpo.policy_loss of `batch` (this rank's rows of the global batch).

        Needs batch.advantages; batch.old_logprobs None means on-policy: the training forward's own
        log-probs, detached, are the old log-probs (ratio exp(lp - lp.detach()) = 1 with the policy
        gradient), and then `importance(sub_batch)` gives the IS weights from them when is_weights is
        None. The result holds the [B, T] old log-probs / IS weights the step used (0 off response_mask;
        the batch itself is not modified).
        With the guard on (engines/guard.py) it may leave sequences out of the loss or skip the update (the
        loss and grad norm are still computed and returned, with the guard_* metrics); step_mismatch: the
        rollout step's global token_mult_prob_error when this batch is one of its optimizer steps (None:
        the guard measures this batch).
        Raises FloatingPointError, without stepping, on a non-finite loss or grad norm (guard or not).
        """
        if batch.advantages is None:
            raise ValueError("batch.advantages: required by train_step (Float32[B, T])")
        t0 = time.perf_counter()
        work = _rows(batch, slice(None))  # a shallow copy: the forward fills its old_logprobs / is_weights
        chunks = row_chunks(batch.input_ids.shape[0], self.micro_batch_size)
        guard = StepGuard(self.guard_spec, self.mesh, step_mismatch) if self.guard_spec is not None else None
        if len(chunks) == 1 and not self.mesh.distributed:
            # the loss's own token count is the kept one here: policy_loss divides by the loss mask's sum
            (_, mask), entropy, loss, metrics = self._loss(work, importance, None, guard)
            if guard is not None:
                guard.reduce()
            grad_norm = self._backward_and_step(loss, guard)
            metrics = {**metrics, "loss": float(loss.detach()), "entropy": masked_mean(entropy, mask)}
        else:
            metrics, grad_norm = self._accumulated_step(work, chunks, importance, guard)
        n_tokens = int(batch.attention_mask.sum()) if batch.attention_mask is not None else batch.input_ids.numel()
        n_tokens = int(self.mesh.all_reduce_sum([n_tokens])[0])
        metrics = {**metrics, "grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"],
                   "train_tokens_per_s": n_tokens / max(time.perf_counter() - t0, 1e-9),
                   **(guard.metrics() if guard is not None else {})}
        return TrainResult(metrics, work.old_logprobs, work.is_weights)

    def _loss(self, batch: TrainBatch, importance: Importance | None, num_tokens: float | None,
              guard: StepGuard | None = None):
        """Forward + grpo.policy_loss of one micro-batch -> ((lp, loss mask), entropy, loss, metrics).

        Fills batch.old_logprobs (and is_weights through `importance`) from the forward when unset. The loss
        mask is the response mask, less the sequences the guard leaves out (action mask).
        """
        mask = batch.response_mask.to(self.device).bool()
        lp, entropy = self._forward(batch.input_ids, batch.attention_mask, self.temperature, with_entropy=True)
        dev = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        if batch.old_logprobs is None:
            batch.old_logprobs = torch.where(mask, lp.detach(), torch.zeros_like(lp))
            if importance is not None and batch.is_weights is None:
                batch.is_weights = importance(batch)
        if guard is not None:  # the old log-probs are known from here on (given, or this forward's)
            mask = guard.observe(batch, mask)
        s = self.loss_spec
        loss, metrics = grpo.policy_loss(lp, dev(batch.old_logprobs), dev(batch.advantages), mask,
                                         dev(batch.is_weights), clip_low=s.clip_low, clip_high=s.clip_high,
                                         ref_logprobs=dev(batch.ref_logprobs), kl_coef=s.kl_coef,
                                         kl_clamp=s.kl_clamp, num_tokens=num_tokens,
                                         gen_logprobs=dev(batch.gen_logprobs), rollout_kl_coef=s.rollout_kl_coef)
        return (lp, mask), entropy, loss, metrics

    def _accumulated_step(self, batch: TrainBatch, chunks: list[slice], importance: Importance | None,
                          guard: StepGuard | None = None) -> tuple[dict[str, float], float]:
        """Micro-batches (and ranks) -> one optimizer step on the global token mean; global metrics.

        L = sum_ranks sum_chunks (sum of the chunk's per-token terms) / n_global, n_global the
        all-reduced count of valid tokens; gradients accumulate over chunks and are summed over ranks
        (FSDP2 reduce-scatter per backward, divide factor 1). Every rank runs the same number of
        chunks (equal local batch sizes), so the collectives of forward/backward pair up.
        With the guard masking sequences, n_global is known only after every chunk's forward (on the reuse
        path the mismatch comes from those forwards): the chunks divide by every response token, and
        gradients and loss metrics are rescaled by n_global / n_kept before clipping (_rescale).
        """
        n_local = int(batch.response_mask.sum())
        n_global = float(self.mesh.all_reduce_sum([n_local])[0])
        self.optimizer.zero_grad(set_to_none=True)
        sums = dict.fromkeys(_SHARE + _MEAN, 0.0)
        ratio_max, bad = 0.0, 0
        olds, weights = [], []
        for i, rows in enumerate(chunks):
            self._sync_gradients(last=i == len(chunks) - 1)
            sub = _rows(batch, rows)
            (_, mask), entropy, loss, m = self._loss(sub, importance, max(n_global, 1.0), guard)
            n = float(mask.sum())
            for k in _SHARE:
                sums[k] += m[k]
            for k in ("clip_fraction", "ratio_mean"):
                sums[k] += m[k] * n
            sums["entropy"] += masked_mean(entropy, mask) * n
            ratio_max = max(ratio_max, m["ratio_max"])
            olds.append(sub.old_logprobs)
            weights.append(sub.is_weights)
            if not torch.isfinite(loss):
                bad += 1
                if not self.mesh.distributed:  # alone: stop now; with peers: every rank must run the same backwards
                    self._raise_non_finite_loss(float(loss.detach()))
            loss.backward()
        _fill_from_chunks(batch, olds, weights)
        red = self.mesh.all_reduce_sum([sums[k] for k in _SHARE + _MEAN] + [bad])
        n_loss = guard.reduce() if guard is not None else n_global  # the tokens the loss keeps (global)
        out = {k: float(v) for k, v in zip(_SHARE, red[:len(_SHARE)])}
        out.update({k: float(v) / n_loss if n_loss else 0.0 for k, v in zip(_MEAN, red[len(_SHARE):-1])})
        out["ratio_max"] = float(self.mesh.all_reduce_max([ratio_max])[0])
        if red[-1] > 0:
            self.optimizer.zero_grad(set_to_none=True)
            self._raise_non_finite_loss(out["loss"])
        if 0 < n_loss < n_global:
            self._rescale(out, n_global / n_loss)
        return out, self._clip_and_step(out["loss"], guard)

    def _rescale(self, out: dict[str, float], factor: float) -> None:
        """Masked sequences: the chunks' losses were sums / n_global (every response token); the token mean
        over the kept ones is factor = n_global / n_kept times that, for the accumulated gradients (sharded
        or not: a pointwise scale) and the summed loss metrics alike. Not taken when nothing is masked, so
        a step inside the band is the unguarded step bit for bit."""
        for k in _SHARE:
            out[k] *= factor
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)

    def _sync_gradients(self, last: bool) -> None:
        """Before each micro-batch's backward. grad_reduce "step": FSDP2 skips the reduce-scatter of every
        backward but the step's last. reshard_after_forward False: nor does it reshard the weights after
        them, so the next micro-batch's forward finds them gathered (no all-gather until the next step)."""
        if not self.mesh.distributed:
            return
        if self.grad_reduce == "step":
            self.model.set_requires_gradient_sync(last)
        if not self.reshard_after_forward:
            self.model.set_reshard_after_backward(last)

    def sft_step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> dict[str, float]:
        """One AdamW step of cross-entropy on the tokens where loss_mask [B, T] is True (temperature 1).

        L = -(1/n) sum_{b,t: loss_mask} log p(input_ids[b, t] | <t). Uses this engine's optimizer and
        lr: build a separate engine (same model) with the warm-start OptimSpec for supervised steps.
        """
        mask = loss_mask.to(self.device).bool()
        lp, _ = self._forward(input_ids, attention_mask, 1.0)
        loss = -torch.where(mask, lp, torch.zeros_like(lp)).sum() / max(int(mask.sum()), 1)
        grad_norm = self._backward_and_step(loss)
        return {"sft_loss": float(loss.detach()), "grad_norm": grad_norm, "tokens": float(mask.sum())}

    def _backward_and_step(self, loss: torch.Tensor, guard: StepGuard | None = None) -> float:
        """backward, clip (report the pre-clip norm), step; raise before stepping if anything is non-finite."""
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            self._raise_non_finite_loss(float(loss.detach()))
        loss.backward()
        return self._clip_and_step(float(loss.detach()), guard)

    def _raise_non_finite_loss(self, value: float) -> None:
        raise FloatingPointError(f"train step {self.step + 1}: non-finite loss {value}; the optimizer did not step")

    def _clip_and_step(self, loss: float, guard: StepGuard | None = None) -> float:
        """Clip the accumulated gradients to grad_clip (global norm over all shards), step; returns the norm.
        A guard that skips (its verdict is global) leaves the weights, AdamW's state and self.step alone."""
        clip = self.optim_spec.grad_clip if self.optim_spec.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor when sharded
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"train step {self.step + 1}: non-finite gradient norm {norm} "
                                     f"(loss {loss:.6g}); the optimizer did not step")
        if guard is None or not guard.skips(norm):
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        # a sharded step's cached Q(W) (reshard_after_forward false) is stale, or after a skip still holds the
        # gathered weights' quantization (re-gathered at the next forward anyway): free it
        if self.mesh.distributed:
            for name in self.fp8_modules:
                self.model.get_submodule(name).invalidate()
        return norm

    def weights(self) -> Mapping[str, torch.Tensor]:
        """HF-named FP32 weights (both keys when tied). Detached VIEWS of the live parameters: they
        change with the next step, so a consumer that keeps them must copy (refit does).
        Sharded: a GatheredWeights mapping that all-gathers one tensor per read (refit layer by layer;
        every rank must read the same keys in the same order)."""
        if self.mesh.distributed:
            return GatheredWeights(self.model)
        return dict(self.model.state_dict())

    def state_dict(self) -> dict:
        """A snapshot (copies) of model weights, AdamW state and the step count, for bit-exact resume.
        Plain tensors, ints and floats only: loadable with torch.load(weights_only=True)."""
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "optimizer": copy.deepcopy(self.optimizer.state_dict()), "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])


def _parallelize(model: torch.nn.Module, mesh: Mesh, cpu_offload: bool, activation_checkpointing: bool,
                 reshard_after_forward: bool = True, mixed_precision: str = "none") -> None:
    """Activation checkpointing, then FSDP2 over the mesh (world size > 1); nothing at world size 1
    (cpu_offload then only applies to the reference policy, fp8rl_core/engines/native_train.py)."""
    if activation_checkpointing or mesh.distributed:
        if activation_checkpointing:
            parallel.apply_activation_checkpointing(model)
        if mesh.distributed:
            parallel.shard_model(model, mesh, cpu_offload=cpu_offload, reshard_after_forward=reshard_after_forward,
                                 mixed_precision=mixed_precision)


def _chunked_logprobs(forward, batch: TrainBatch, temperature: float, chunk: int) -> torch.Tensor:
    """Float32[B, T] no-grad log-probs, `chunk` rows per forward; 0 off response_mask."""
    parts = []
    with torch.no_grad():
        for rows in row_chunks(batch.input_ids.shape[0], chunk):
            lp, _ = forward(batch.input_ids[rows], batch.attention_mask[rows], temperature)
            mask = batch.response_mask[rows].to(lp.device).bool()
            parts.append(torch.where(mask, lp, torch.zeros_like(lp)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _fill_from_chunks(batch: TrainBatch, olds: list[torch.Tensor], weights: list[torch.Tensor | None]) -> None:
    """Reassemble the per-micro-batch old log-probs / IS weights into the whole batch's [B, T]."""
    if batch.old_logprobs is None:
        batch.old_logprobs = torch.cat(olds)
    if batch.is_weights is None and all(w is not None for w in weights):
        batch.is_weights = torch.cat(weights)


class ReferencePolicy:
    """The frozen reference policy of the KL term: log-probs only, no optimizer, no gradients.

    model: loaded in the compute dtype (BF16; FP32 in tests), never a second FP32 master copy;
    fp8 recipes run its linears through Fp8Linear like the policy. Sharded with FSDP2 like the policy
    at world size > 1 (CPU-offloaded shards with cpu_offload); alone with cpu_offload on a GPU, it
    stays on the CPU and visits the GPU for each pass. padding_free: as the policy's engine.
    """

    def __init__(self, model: CausalLM, *, device: torch.device | str, recipe: Recipe = BF16,
                 temperature: float = 1.0,
                 compute_dtype: torch.dtype = torch.bfloat16, mesh: Mesh | None = None,
                 logprob_batch_size: int = 0, cpu_offload: bool = False, upcast_bf16: bool = False,
                 padding_free: bool = False) -> None:
        model.requires_grad_(False).eval()
        if recipe.fp8_training:
            apply_fp8(model, recipe, compute_dtype)
        if upcast_bf16 and compute_dtype == torch.bfloat16:
            upcast_bf16_matmuls(model)
        self.mesh, self.device = mesh or SINGLE, torch.device(device)
        self.offload = cpu_offload and not self.mesh.distributed and self.device.type != "cpu"
        self.model = model.to("cpu" if self.offload else self.device)
        if self.mesh.distributed:
            shard_model(model, self.mesh, cpu_offload=cpu_offload, sum_gradients=False)
        self.temperature, self.compute_dtype = float(temperature), compute_dtype
        self.logprob_batch_size, self.padding_free = int(logprob_batch_size), bool(padding_free)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float):
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.compute_dtype == torch.bfloat16)
        return model_logprobs(self.model, input_ids.to(self.device), attention_mask.to(self.device), temperature,
                              autocast, padding_free=self.padding_free)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Float32[B, T] reference log-probs of batch.input_ids; 0 off response_mask."""
        if self.offload:
            self.model.to(self.device)
        try:
            return _chunked_logprobs(self._forward, batch, self.temperature, self.logprob_batch_size)
        finally:
            if self.offload:
                self.model.to("cpu")
