"""Attribution replay, the numerical part: re-score one rollout batch with two controlled "engines" and
say how far apart they are, token by token (the catalogue) and layer by layer (hidden states).

A side is a `Scorer`: `score(ids Long[L]) -> (logprobs Float[L], hidden [n_layers] x Float[L, H])`, the
log-prob of each token given the ones before it (0 at position 0) and every decoder layer's output (the
residual stream after the block, before the final norm). Two scorers:
- `TrainKernels`: the training engine's model (fp8rl_core/model/layers.py kernels, FP32 masters under
  BF16 autocast, as NativeTrainingEngine runs it), optionally with blockwise-FP8 fake quantization of
  the weights ([128,128]) and/or the input activations ([1,128]) of the linears a recipe quantizes
  (lm_head and the recipe's kept blocks excluded); the GEMM then runs in FP32 on the dequantized
  values (exact E4M3 products, FP32 accumulation: FP8 GEMM semantics up to summation order). Q(W)
  quantizes what the run's engines quantize: the weight rounded to `quantize_dtype` first (BF16 under
  `fp8.quantize_from: bf16`, the default; fp8rl_core/model/fp8_policy.py `quantize_source`), or the FP32
  master as stored (None);
- `GenKernels`: the generation engine (fp8rl_core/engines/native_gen.py) prefill path, in its dtype,
  FP8 or not as built. Hidden states are read by wrapping the engine's `add_rms_norm` (called twice per
  layer; the second call's residual is the layer output) for the duration of a call.

relative error of layer l = ||h_A − h_B||_F / ||h_A||_F over every real token of the batch (float64).
"""
from __future__ import annotations

import copy
import fnmatch
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl_core.diagnostics.catalogue import step_diagnostics


class Scorer(Protocol):
    name: str

    def score(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]: ...


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Float32[L]: log_softmax(logits[t-1] / T)[ids[t]], 0 at t = 0 (both engines' convention)."""
    logp = torch.log_softmax(logits[:-1].float() / temperature, dim=-1)
    return F.pad(logp.gather(-1, ids[1:, None]).squeeze(-1), (1, 0))


class _FakeQuantLinear(nn.Module):
    """y = Q(x)[1,128] · Q(W)[128,128]ᵀ + b with Q = quantize→dequantize E4M3, each Q optional, in FP32.

    Without a Q the operand is the BF16 value autocast would feed the GEMM (x as it arrives, W cast to
    BF16), so switching one Q on changes exactly one source of error. Output in x's dtype.
    """

    def __init__(self, linear: nn.Linear, weights: bool, activations: bool, power_of_two: bool,
                 quantize_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        from fp8rl_core.fp8 import dequantize_blockwise, quantize_blockwise

        self.linear, self.activations, self.power_of_two = linear, activations, power_of_two
        self._q, self._dq = quantize_blockwise, dequantize_blockwise
        w = linear.weight.detach()
        if weights:
            # the run's Q(W) source: its BF16 rounding (quantize_from bf16), not the FP32 master, else this
            # variant quantizes other weights than both engines do (block scales and codes move)
            src = w if quantize_dtype is None else w.to(quantize_dtype)
            q, s = quantize_blockwise(src.float(), (128, 128), power_of_two=power_of_two)
            self.w = dequantize_blockwise(q, s, (128, 128))
        else:
            self.w = w.to(torch.bfloat16).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, x.shape[-1])
            if self.activations:
                q, s = self._q(x2, (1, 128), power_of_two=self.power_of_two, check_finite=False)
                xf = self._dq(q, s, (1, 128))
            else:
                xf = x2.float()
            y = F.linear(xf, self.w, None if self.linear.bias is None else self.linear.bias.float())
        return y.to(x.dtype).reshape(*x.shape[:-1], self.w.shape[0])


def fake_quantize(model: nn.Module, exclude: tuple[str, ...], weights: bool, activations: bool,
                  power_of_two: bool = False, quantize_dtype: torch.dtype | None = None) -> list[str]:
    """Swap, in place, every nn.Linear not matching `exclude` (fnmatch) for a _FakeQuantLinear
    (quantize_dtype: what Q(W) rounds the weight to first, None: as stored)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)
             and not any(fnmatch.fnmatch(n, pat) for pat in exclude)]
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, _FakeQuantLinear(getattr(parent, leaf), weights, activations, power_of_two,
                                                    quantize_dtype))
    return names


class TrainKernels:
    """The training engine's kernels on a private copy of `model` (FP32 masters; BF16 autocast unless
    compute_dtype is FP32), with optional FP8 fake quantization (see module docstring; quantize_dtype:
    the dtype Q(W) rounds a weight to first, as the run's `fp8.quantize_from` says, None: the master)."""

    def __init__(self, model: nn.Module, name: str, *, temperature: float = 1.0,
                 compute_dtype: torch.dtype = torch.bfloat16, quant_weights: bool = False,
                 quant_activations: bool = False, exclude: tuple[str, ...] = ("lm_head",),
                 power_of_two: bool = False, quantize_dtype: torch.dtype | None = None) -> None:
        self.name, self.temperature, self.compute_dtype = name, temperature, compute_dtype
        self.model = copy.deepcopy(model).float().eval()
        if quant_weights or quant_activations:
            fake_quantize(self.model, exclude, quant_weights, quant_activations, power_of_two, quantize_dtype)
        self._hidden: list[torch.Tensor] = []
        for layer in self.model.model.layers:
            # a DecoderLayer returns the residual stream [1, L, H] (one row per call): keep [L, H]
            layer.register_forward_hook(lambda _m, _i, out: self._hidden.append(out[0].detach()))

    @torch.no_grad()
    def score(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self._hidden = []
        dev = next(self.model.parameters()).device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=self.compute_dtype == torch.bfloat16):
            logits = self.model(ids[None].to(dev))[0]
        return _token_logprobs(logits, ids.to(dev), self.temperature).cpu(), [h.cpu() for h in self._hidden]


class GenKernels:
    """The generation engine's prefill kernels (an already refit NativeGenerationEngine)."""

    def __init__(self, engine, name: str, *, temperature: float = 1.0) -> None:
        self.engine, self.name, self.temperature = engine, name, temperature

    @contextmanager
    def _capture(self) -> Iterator[list[torch.Tensor]]:
        from fp8rl_core.engines import native_gen

        real, seen = native_gen.add_rms_norm, []

        def recording(x, residual, weight, eps):
            out = real(x, residual, weight, eps)
            seen.append(out[1].detach().clone())  # the residual stream after this add
            return out

        native_gen.add_rms_norm = recording
        try:
            yield seen
        finally:
            native_gen.add_rms_norm = real

    @torch.no_grad()
    def score(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with self._capture() as seen:
            logits = self.engine.logits(ids[None].to(self.engine.device))[0]
        n = self.engine.config.num_hidden_layers
        # two residual adds per layer (after attention, after the MLP); anything else means the engine's
        # forward changed shape: report no hidden states rather than wrong ones
        hidden = [seen[2 * i + 1][0].cpu() for i in range(n)] if len(seen) == 2 * n else []
        return _token_logprobs(logits, ids.to(logits.device), self.temperature).cpu(), hidden


@dataclass
class VariantResult:
    name: str
    description: str
    metrics: dict[str, float]
    layer_rel_err: list[float] = field(default_factory=list)  # one per decoder layer; empty: not measured

    @property
    def first_divergent_layer(self) -> int | None:
        """The first layer whose output differs at all (None: none does)."""
        return next((i for i, e in enumerate(self.layer_rel_err) if e > 0), None)

    @property
    def largest_jump_layer(self) -> int | None:
        """The layer whose relative error grows the most over the previous layer's (None: no error)."""
        errs = [0.0 if math.isnan(e) else e for e in self.layer_rel_err]
        jumps = [e - (errs[i - 1] if i else 0.0) for i, e in enumerate(errs)]
        return None if not jumps or max(jumps) <= 0 else max(range(len(jumps)), key=jumps.__getitem__)


def rows_of(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[torch.Tensor]:
    """The real tokens of each right-padded row."""
    return [input_ids[b, attention_mask[b].bool()] for b in range(input_ids.shape[0])]


def compare(a: Scorer, b: Scorer, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            response_mask: torch.Tensor, name: str = "", description: str = "",
            advantages: torch.Tensor | None = None) -> VariantResult:
    """Score every row of a right-padded batch (input_ids Long[B, T], masks Bool[B, T]) with both
    sides; side a plays the trainer (its log-probs are `train`), side b the generator (`gen`).

    metrics: the catalogue (step_diagnostics) over the response tokens, IS weights w = exp(a − b) (a
    non-finite one 0: the catalogue's is_masked split), advantages Float[B] or Float[B, T] (the rollout's,
    when it saved them; None: the adv_pos / adv_neg splits are nan);
    layer_rel_err[l] = sqrt(Σ_rows ||h_a − h_b||²) / sqrt(Σ_rows ||h_a||²) over every real token.
    """
    B, T = input_ids.shape
    lp_a = torch.zeros(B, T, dtype=torch.float32)
    lp_b = torch.zeros(B, T, dtype=torch.float32)
    num: list[float] = []
    den: list[float] = []
    measured = True
    for r, ids in enumerate(rows_of(input_ids, attention_mask)):
        la, ha = a.score(ids)
        lb, hb = b.score(ids)
        lp_a[r, :len(ids)], lp_b[r, :len(ids)] = la, lb
        if not ha or not hb or len(ha) != len(hb):
            measured = False
            continue
        if not num:
            num, den = [0.0] * len(ha), [0.0] * len(ha)
        for i, (x, y) in enumerate(zip(ha, hb)):
            x64, y64 = x.double(), y.double()
            num[i] += float(((x64 - y64) ** 2).sum())
            den[i] += float((x64 ** 2).sum())
    mask = response_mask.bool()
    w = torch.nan_to_num(torch.exp(lp_a.double() - lp_b.double()), nan=0.0, posinf=0.0, neginf=0.0)
    metrics = step_diagnostics(lp_a, lp_b, mask, torch.where(mask, w, torch.zeros_like(w)), advantages=advantages)
    errs = [math.sqrt(n) / math.sqrt(d) if d > 0 else math.nan for n, d in zip(num, den)] if measured else []
    return VariantResult(name or f"{a.name} vs {b.name}", description, metrics, errs)
