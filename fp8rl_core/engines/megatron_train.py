"""The Megatron-Core training engine: our GRPO step on Megatron's GPTModel (Transformer Engine layers).

What a real RL pipeline trains with (NeMo RL's Megatron policy): Megatron-Core's GPTModel with the
Transformer Engine layer spec (fused RMSNorm+Linear, TE attention); `fp8_e2e` trains its linear
layers in blockwise FP8 through TE's Float8BlockScaling recipe (fp8_recipe="blockwise", FP32 scales
via NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1), the embedding, norms, attention and output layer in BF16.

Everything above the model is shared with the native trainer, so that a backend changes kernels,
not the algorithm: the GPTModel is wrapped to look like our CausalLM and driven by a
NativeTrainingEngine, i.e. the same `token_logprobs`, `grpo.policy_loss`, metrics, AdamW on FP32
master weights, BF16 autocast, gradient clipping and non-finite guards.

Parallelism (engines.megatron, megatron_parallel.py): Megatron's parallel state is initialized with the
run config's tensor/pipeline sizes, and the TransformerConfig gets them too. What this engine runs
today is one rank per model replica with tensor = pipeline = data-parallel size 1: `check_layout`
refuses any other layout with what is missing (Megatron's DistributedDataParallel + distributed
optimizer for data parallelism, with the global token-level loss normalization; TP-aware gradient
clipping and weight gathering for tensor parallelism; Megatron's pipeline schedules), instead of
letting ranks silently train on different batches without exchanging gradients. The pieces for them
(config mapping, TP-sharded HF <-> Megatron conversion) are in megatron_parallel.py, tested on a CPU.
FP8 training pads every batch on the right to B x T a multiple of engines.megatron.pad_tokens_to
(Transformer Engine's FP8 GEMMs need it; padding is causal-invisible and sliced off the logits).
Checkpoints (`state_dict`) are staged on the CPU: HF-named weights and the AdamW state are copied to
host memory, never cloned on the GPU (an 8B model would need about +90 GiB there).

Megatron-Core and Transformer Engine are imported lazily: a CPU install never needs them. Without
CUDA or megatron-core the constructor raises a RuntimeError that says what to install.
"""
from __future__ import annotations

import copy
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8rl_core.config import LossSpec, MegatronSpec, OptimSpec
from fp8rl_core.config.recipe import BF16, Quantization, Recipe
from fp8rl_core.engines.base import Importance, TrainBatch, TrainResult
from fp8rl_core.engines.megatron_convert import (
    FP32_SCALES_ENV,
    fp8_env,
    gpt_model_kwargs,
    hf_to_megatron,
    load_megatron_state,
    megatron_to_hf,
    transformer_config_kwargs,
)
from fp8rl_core.engines.megatron_parallel import (
    model_parallel_kwargs,
    padded_length,
    parallel_sizes,
    transformer_parallel_kwargs,
)
from fp8rl_core.engines.native_train import NativeTrainingEngine
from fp8rl_core.io.ports import free_port
from fp8rl_core.model.config import ModelConfig
from fp8rl_core.model.llama import positions_and_mask

INSTALL_HINT = ("run it on a CUDA machine with `pip install 'fp8rl[megatron]'` (megatron-core + transformer-engine), "
                "or use engines.training=native")


def require_megatron(fp8_training: bool) -> None:
    """Raise RuntimeError naming what is missing: a CUDA GPU, megatron-core, and (FP8) Transformer Engine.

    Checks with find_spec, without importing: Transformer Engine reads its FP8 environment variables
    when it is imported, so the import must wait until fp8_env is applied.
    """
    missing = []
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU (torch.cuda.is_available() is False)")
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        missing.append("megatron-core")
    if fp8_training and importlib.util.find_spec("transformer_engine") is None:
        missing.append("transformer-engine (FP8 training runs through its blockwise recipe)")
    if missing:
        raise RuntimeError(f"engines.training=megatron needs {', '.join(missing)}; {INSTALL_HINT}")
    from fp8rl_core.engines.versions import check_stack

    check_stack(("megatron-core", "transformer-engine") if fp8_training else ("megatron-core",))


def apply_env(env: Mapping[str, str]) -> None:
    """Set Transformer Engine's environment; refuse if TE is already imported with another value."""
    for key, value in env.items():
        if os.environ.get(key) != value and "transformer_engine" in sys.modules:
            raise RuntimeError(f"{key}={value} must be set before transformer_engine is imported (it is read at "
                               f"import time; now {os.environ.get(key)!r}): export it in the job environment")
        os.environ[key] = value


def init_distributed(backend: str = "nccl") -> tuple[int, int, int]:
    """(rank, world_size, local_rank), initializing torch.distributed if nobody has.

    Inside a submitit SLURM job (SUBMITIT_EXECUTOR=slurm): rank, world size and master address from
    submitit's TorchDistributedEnvironment (env:// rendezvous). Elsewhere: one process, rank 0 of 1,
    on a free loopback port.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        from submitit.helpers import TorchDistributedEnvironment

        env = TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size)
        return env.rank, env.world_size, env.local_rank
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    return 0, 1, 0


def check_layout(spec: MegatronSpec, world_size: int, cfg: ModelConfig | None = None) -> tuple[int, int, int]:
    """(tp, pp, dp) of the run; RuntimeError for any layout but 1 x 1 x 1, naming what is missing."""
    tp, pp, dp = parallel_sizes(spec, world_size, cfg)
    missing = []
    if dp > 1:
        missing.append(f"data parallelism ({dp} replicas): Megatron's DistributedDataParallel and distributed "
                       "optimizer with the global token-level loss normalization are not wired into this engine")
    if tp > 1:
        missing.append(f"tensor parallelism ({tp}): TP-aware gradient clipping and weight gathering for refit")
    if pp > 1:
        missing.append(f"pipeline parallelism ({pp}): Megatron's pipeline schedules")
    if missing:
        raise RuntimeError("engines.training=megatron runs one model replica on one rank (tensor = pipeline = "
                           f"data-parallel size 1); this run asks for {'; '.join(missing)}. Valid: one rank per cell "
                           "with engines.megatron.tensor_parallel_size=pipeline_parallel_size=1, or "
                           "engines.training=native (FSDP2 over every rank)")
    return tp, pp, dp


def init_model_parallel(seed: int, spec: MegatronSpec | None = None) -> None:
    """Megatron's parallel state with the run's tensor / pipeline sizes (megatron_parallel.py; data parallel
    = what is left of the world size), and on CUDA its RNG tracker (model_parallel_cuda_manual_seed),
    which attention's dropout region forks."""
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(**model_parallel_kwargs(spec or MegatronSpec()))
    # Seed the tracker once per process: a second engine (the KL reference) must not reset CUDA's RNG.
    if torch.cuda.is_available() and not tensor_parallel.get_cuda_rng_tracker().is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def build_gpt_model(model_cfg: ModelConfig, recipe: Recipe = BF16, *,
                    use_te: bool = True, device: str = "cuda", parallel: MegatronSpec | None = None) -> nn.Module:
    """An uninitialized GPTModel of our architecture (weights to be loaded), FP32 parameters.

    use_te: the Transformer Engine layer spec (required for FP8); else Megatron's local spec
    (torch RMSNorm, ColumnParallelLinear, DotProductAttention), which also builds on a CPU.
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = {**transformer_config_kwargs(model_cfg, recipe),
          **transformer_parallel_kwargs(parallel or MegatronSpec())}
    if kw.get("fp8") and not use_te:
        raise ValueError(f"recipe {recipe.name!r}: FP8 training needs the Transformer Engine layer spec (use_te=True)")
    config = TransformerConfig(**kw, use_cpu_initialization=device == "cpu", perform_initialization=False)
    spec = (get_gpt_layer_with_transformer_engine_spec() if use_te
            else get_gpt_layer_local_spec(normalization="RMSNorm"))
    return GPTModel(config, spec, **gpt_model_kwargs(model_cfg)).to(device)


def gpt_logits(gpt: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, T, V] of a GPTModel for right-padded input_ids Long[B, T] (attention_mask [B, T], 1 = real).

    Causal attention only: right padding needs no padding mask (a real token never sees a later pad),
    and Megatron's RoPE takes positions 0..T-1, so other layouts (left padding) are refused.
    On CUDA the layers build their causal mask themselves; on a CPU an explicit one is passed
    (Bool[1, 1, T, T], True = masked), because Megatron's default mask is allocated on CUDA.
    """
    positions, mask = positions_and_mask(input_ids, attention_mask)
    if mask is not None:
        raise ValueError("attention_mask: the Megatron engine needs right-padded rows (real tokens, then padding)")
    t = input_ids.shape[1]
    causal = None
    if not input_ids.is_cuda:
        causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]
    return gpt(input_ids, positions, causal)


class GPTAsCausalLM(nn.Module):
    """A GPTModel called like our CausalLM: (input_ids [B, T], attention_mask [B, T] | None) -> logits.

    pad_to > 1: the batch is right-padded to B x T' a multiple of pad_to (Transformer Engine's FP8
    layers; megatron_parallel.padded_length) and the logits are cut back to T: right padding never
    changes a real token's logits under causal attention.
    """

    def __init__(self, gpt: nn.Module, pad_to: int = 1) -> None:
        super().__init__()
        self.gpt, self.pad_to = gpt, pad_to

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t = input_ids.shape
        extra = padded_length(b, t, self.pad_to) - t
        if extra:
            input_ids = F.pad(input_ids, (0, extra))
            if attention_mask is None:
                attention_mask = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
            attention_mask = F.pad(attention_mask.bool(), (0, extra))
        return gpt_logits(self.gpt, input_ids, attention_mask)[:, :t]


def uses_te_norms(gpt: nn.Module) -> bool:
    return any(k.endswith("linear_qkv.layer_norm_weight") for k, _ in gpt.named_parameters())


def _check_te_scales(fp8: Quantization) -> None:
    """TE's blockwise recipe must quantize with the scales we asked for (the env var is read at import)."""
    from transformer_engine.common.recipe import Float8BlockScaling

    if Float8BlockScaling().fp8_quant_fwd_weight.power_2_scale != fp8.power_of_two_scales:
        raise RuntimeError(f"Transformer Engine's Float8BlockScaling has power_2_scale="
                           f"{not fp8.power_of_two_scales}, the run asks for power_of_two_scales="
                           f"{fp8.power_of_two_scales}: set {FP32_SCALES_ENV} in the job environment")


def _to_host(obj: Any) -> Any:
    """A copy of a nested state (dicts, lists, tuples) with every tensor copied to the CPU (a new tensor
    even when it is already there, so the checkpoint never aliases live parameters or moments)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return copy.deepcopy(obj)


class MegatronTrainingEngine:
    """TrainingEngine (fp8rl_core/engines/base.py) on Megatron-Core's GPTModel.

    path: a local HF checkpoint folder (config.json + safetensors), loaded with our loader.
    recipe: its `training` side runs in TE's FP8 layers; megatron: engines.megatron (parallel layout,
    padding); loss, optim, temperature, compute_dtype: as NativeTrainingEngine's; seed: Megatron's RNG.
    Weights in and out use HF names (weights(), state_dict()["model"]), so a checkpoint is portable.
    """

    reports_old_logprobs = False  # train_step reports metrics only: the loop scores the batch first

    def __init__(self, path: str | Path, *, recipe: Recipe, megatron: MegatronSpec, loss: LossSpec,
                 optim: OptimSpec, temperature: float, compute_dtype: torch.dtype, seed: int) -> None:
        require_megatron(recipe.fp8_training)
        apply_env(fp8_env(recipe))  # before anything imports transformer_engine
        from fp8rl_core.model.hf_io import load_pretrained, read_model_config

        model_cfg = read_model_config(Path(path))
        _, world, local_rank = init_distributed("nccl")
        check_layout(megatron, world, model_cfg)
        torch.cuda.set_device(local_rank)
        init_model_parallel(seed, megatron)
        if recipe.training is not None:
            _check_te_scales(recipe.training)
        gpt = build_gpt_model(model_cfg, recipe, use_te=te_available(), device="cuda", parallel=megatron)
        hf_state = load_pretrained(Path(path), dtype=torch.float32).state_dict()
        self._attach(gpt, model_cfg, hf_state, recipe=recipe, megatron=megatron, loss=loss, optim=optim,
                     temperature=temperature, compute_dtype=compute_dtype)

    @classmethod
    def from_gpt_model(cls, gpt: nn.Module, model_cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor],
                       **engine_args: Any) -> MegatronTrainingEngine:
        """Wrap an already built GPTModel (any device), loading `hf_state` into it; no environment checks.
        engine_args: recipe, megatron, loss, optim, temperature, compute_dtype (as __init__)."""
        engine = cls.__new__(cls)
        engine._attach(gpt, model_cfg, hf_state, **engine_args)
        return engine

    def _attach(self, gpt: nn.Module, model_cfg: ModelConfig, hf_state: Mapping[str, torch.Tensor], *,
                recipe: Recipe, megatron: MegatronSpec, loss: LossSpec, optim: OptimSpec, temperature: float,
                compute_dtype: torch.dtype) -> None:
        load_megatron_state(gpt, hf_to_megatron(hf_state, model_cfg, te_fused_norms=uses_te_norms(gpt)))
        self.gpt, self.model_config = gpt, model_cfg
        # FP8 runs inside TE's layers (TransformerConfig.fp8), so the shared engine does no Fp8Linear swap.
        pad_to = megatron.pad_tokens_to if recipe.fp8_training else 1
        self.inner = NativeTrainingEngine(GPTAsCausalLM(gpt, pad_to), loss=loss, optim=optim,
                                          temperature=temperature, compute_dtype=compute_dtype)

    @property
    def step(self) -> int:
        return self.inner.step

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Float32[B, T] log-probs of batch.input_ids (temperature-scaled), 0 off response_mask."""
        return self.inner.logprobs(batch)

    def train_step(self, batch: TrainBatch, importance: Importance | None = None,
                   step_mismatch: float | None = None) -> TrainResult:
        """One AdamW step of grpo.policy_loss: the native trainer's step, loss and metrics. Its old log-probs
        are not reported (reports_old_logprobs False): the loop scores the batch first (`logprobs`)."""
        if importance is not None:
            raise ValueError("MegatronTrainingEngine: reports_old_logprobs is False; score the batch first")
        return TrainResult(self.inner.train_step(batch, step_mismatch=step_mismatch).metrics)

    def sft_step(self, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> dict[str, float]:
        return self.inner.sft_step(input_ids, loss_mask, attention_mask)

    def weights(self) -> dict[str, torch.Tensor]:
        """HF-named FP32 weights (both keys when tied); q/k/v and gate/up are views or copies of the
        fused parameters: a consumer that keeps them must copy (refit does)."""
        # parameters, not state_dict(): TE would serialize its FP8 metadata (_extra_state) on every refit
        return megatron_to_hf({k: p.detach() for k, p in self.gpt.named_parameters()}, self.model_config)

    def state_dict(self) -> dict[str, Any]:
        """Host copies of the weights (HF names), AdamW state and the step: loadable with weights_only=True.
        Staged on the CPU tensor by tensor: nothing is cloned on the GPU (an 8B model's weights and
        AdamW state would need about +90 GiB there)."""
        return {"model": {k: _to_host(v) for k, v in self.weights().items()},
                "optimizer": _to_host(self.inner.optimizer.state_dict()), "step": self.inner.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_megatron_state(self.gpt, hf_to_megatron(state["model"], self.model_config,
                                                     te_fused_norms=uses_te_norms(self.gpt)))
        self.inner.optimizer.load_state_dict(state["optimizer"])
        self.inner.step = int(state["step"])
