"""The native training engine: full-sequence forward/backward with autograd, AdamW on FP32 masters.

Plays Megatron-Core's part (DESIGN.md "The two engines"): training-style kernels (fp8rl_core/model/
layers.py), parameters and optimizer state in FP32, compute in BF16 through `torch.autocast` (BF16
recipe) or through `Fp8Linear` forward and backward for `fp8_e2e` (the linear layers except lm_head
and the Fp8Spec's kept blocks; embeddings, norms, attention and the head stay BF16 under autocast).

Log-probabilities: lp[b, t] = log_softmax(logits[b, t-1] / temperature)[input_ids[b, t]], in FP32,
0 at t = 0 and wherever response_mask is False: the distribution the generation engine samples from
(before top-k/top-p), so that the two engines' numbers are comparable token by token.
"""
from __future__ import annotations

import copy
import math
import time
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F

from fp8rl_core import grpo
from fp8rl_core.config import Fp8Spec, LossSpec, OptimSpec
from fp8rl_core.engines.base import TrainBatch
from fp8rl_core.model.fp8_policy import apply_fp8
from fp8rl_core.model.llama import CausalLM


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


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(torch.where(mask, x, torch.zeros_like(x)).sum()) / n if n else 0.0


class NativeTrainingEngine:
    """TrainingEngine (fp8rl_core/engines/base.py) on our CausalLM.

    model:        the policy with FP32 parameters (the master weights), on the device to train on;
                  with fp8_training its linear layers are swapped for Fp8Linear in place.
    compute_dtype: torch.bfloat16 (autocast) or torch.float32 (no autocast; for tests).
    optim:        AdamW(lr, betas, eps, weight_decay on every parameter), grad_clip (<= 0: off).
    One `train_step` is one optimizer step; the caller splits a rollout batch into micro-steps.
    """

    def __init__(self, model: CausalLM, *, fp8_training: bool = False, fp8_spec: Fp8Spec | None = None,
                 loss: LossSpec | None = None, optim: OptimSpec | None = None, temperature: float = 1.0,
                 compute_dtype: torch.dtype = torch.bfloat16) -> None:
        bad = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"model: master weights must be float32; {bad[0]} is {model.get_parameter(bad[0]).dtype}")
        if compute_dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"compute_dtype: {compute_dtype} not supported; valid: torch.bfloat16, torch.float32")
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        self.model, self.temperature, self.compute_dtype = model, float(temperature), compute_dtype
        self.loss_spec, self.optim_spec = loss or LossSpec(), optim or OptimSpec()
        self.fp8_modules = apply_fp8(model, fp8_spec or Fp8Spec()) if fp8_training else []
        o = self.optim_spec
        self.params = list(model.parameters())  # tied weights appear once
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=(o.betas[0], o.betas[1]), eps=o.eps,
                                           weight_decay=o.weight_decay)
        self.step = 0

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def _autocast(self) -> AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.compute_dtype == torch.bfloat16)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, temperature: float,
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self._autocast():
            logits = self.model(input_ids.to(self.device), None if attention_mask is None
                                else attention_mask.to(self.device))
        return token_logprobs(logits, input_ids.to(self.device), temperature, with_entropy)

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Float32[B, T] log-probs of batch.input_ids under the current weights; 0 off response_mask."""
        with torch.no_grad():
            lp, _ = self._forward(batch.input_ids, batch.attention_mask, self.temperature)
        mask = batch.response_mask.to(lp.device).bool()
        return torch.where(mask, lp, torch.zeros_like(lp))

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One AdamW step on grpo.policy_loss of `batch`.

        Needs batch.advantages; batch.old_logprobs None means on-policy (the current log-probs,
        detached). Raises FloatingPointError, without stepping, on a non-finite loss or grad norm.
        """
        if batch.advantages is None:
            raise ValueError("batch.advantages: required by train_step (Float32[B, T])")
        t0 = time.perf_counter()
        mask = batch.response_mask.to(self.device).bool()
        lp, entropy = self._forward(batch.input_ids, batch.attention_mask, self.temperature, with_entropy=True)
        dev = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        old = lp.detach() if batch.old_logprobs is None else dev(batch.old_logprobs)
        s = self.loss_spec
        loss, metrics = grpo.policy_loss(lp, old, dev(batch.advantages), mask, dev(batch.is_weights),
                                         clip_low=s.clip_low, clip_high=s.clip_high,
                                         ref_logprobs=dev(batch.ref_logprobs), kl_coef=s.kl_coef, kl_clamp=s.kl_clamp)
        grad_norm = self._backward_and_step(loss)
        n_tokens = int(batch.attention_mask.sum()) if batch.attention_mask is not None else batch.input_ids.numel()
        return {**metrics, "loss": float(loss.detach()), "grad_norm": grad_norm, "entropy": masked_mean(entropy, mask),
                "lr": self.optimizer.param_groups[0]["lr"],
                "train_tokens_per_s": n_tokens / max(time.perf_counter() - t0, 1e-9)}

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

    def _backward_and_step(self, loss: torch.Tensor) -> float:
        """backward, clip (report the pre-clip norm), step; raise before stepping if anything is non-finite."""
        self.optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"train step {self.step + 1}: non-finite loss {float(loss.detach())}; "
                                     "the optimizer did not step")
        loss.backward()
        clip = self.optim_spec.grad_clip if self.optim_spec.grad_clip > 0 else math.inf
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"train step {self.step + 1}: non-finite gradient norm {norm} "
                                     f"(loss {float(loss.detach()):.6g}); the optimizer did not step")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return norm

    def weights(self) -> dict[str, torch.Tensor]:
        """HF-named FP32 weights (both keys when tied). Detached VIEWS of the live parameters: they
        change with the next step, so a consumer that keeps them must copy (refit does)."""
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
