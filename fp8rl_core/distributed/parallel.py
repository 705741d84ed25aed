"""Parallelism applied to a CausalLM, one small function per concern (as torchtitan does).

- `apply_activation_checkpointing`: recompute each transformer block's activations in backward;
- `shard_model`: FSDP2 (`fully_shard`) per transformer block, then the root (embeddings, final norm,
  LM head: one group, so tied embeddings stay one parameter); optional CPU offload of the shards;
- `GatheredWeights`: the HF-named full weights of a sharded model, all-gathered one tensor at a time
  when read, so a consumer (refit) holds one layer more than its own copy, never a second model.

Gradients: each rank's loss is its share of the GLOBAL token mean (its token sum / the global count),
so the true gradient is the SUM over ranks; FSDP2's default averages, hence divide factor 1.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fp8rl_core.distributed.mesh import Mesh
from fp8rl_core.fp8.linear import Fp8Linear


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Wrap every block's forward (model.model.layers[i]) in non-reentrant checkpointing. Returns the count.

    The wrap is an instance attribute, so module names and state_dict keys do not change, and FSDP2's
    hooks (registered on the module, around forward) still all-gather before the recompute.
    """
    layers = model.model.layers
    for layer in layers:
        if getattr(layer, "_fp8rl_checkpointed", False):
            continue
        inner = layer.forward
        layer.forward = functools.partial(checkpoint, inner, use_reentrant=False)
        layer._fp8rl_checkpointed = True
    return len(layers)


def shard_model(model: nn.Module, mesh: Mesh, *, cpu_offload: bool = False, sum_gradients: bool = True,
                reshard_after_forward: bool = True, mixed_precision: str = "none") -> nn.Module:
    """FSDP2 over mesh.device_mesh: fully_shard each block, then the root; in place, returns the model.

    cpu_offload: parameters, gradients and optimizer state live on the CPU between uses
    (CPUOffloadPolicy); the optimizer then steps on the CPU. sum_gradients: reduce-scatter sums
    (divide factor 1) instead of FSDP's mean (see the module docstring). reshard_after_forward:
    False keeps every block's gathered weights for the step (the engine keeps them across its
    micro-batches too: one all-gather per step; each rank then holds the full weights during the
    step), and with them Fp8Linear's cached Q(W): each weight quantized once per step, not per forward.
    mixed_precision (parallel.mixed_precision): "bf16" all-gathers BF16 copies of the FP32 shards
    (MixedPrecisionPolicy param_dtype bf16) and reduce-scatters gradients in FP32 (reduce_dtype); the shards,
    the optimizer and checkpoints stay FP32. "none": no policy (FP32 gathered, FP32 reduced).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    if not mesh.distributed:
        raise ValueError("shard_model: needs world size > 1 (a single process trains unsharded)")
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    kw = {"mesh": mesh.device_mesh, "reshard_after_forward": reshard_after_forward, "offload_policy": offload,
          "mp_policy": mixed_precision_policy(mixed_precision)}
    if reshard_after_forward:
        _no_weight_cache(model)
    modules = [fully_shard(layer, **kw) for layer in model.model.layers]
    modules.append(fully_shard(model, **kw))
    if sum_gradients:
        for m in modules:
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no PREMUL_SUM; NCCL's zero-copy path
    return model


def mixed_precision_policy(name: str):
    """parallel.mixed_precision -> FSDP2's MixedPrecisionPolicy: none -> the default policy (no casts),
    bf16 -> param_dtype bf16, reduce_dtype fp32 (torchtitan's default for BF16 training)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if name == "none":
        return MixedPrecisionPolicy()
    if name == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"mixed_precision: {name!r} not supported; valid: none, bf16")


def _no_weight_cache(model: nn.Module) -> None:
    """Fp8Linear keeps Q(W) between forwards; under FSDP2 with resharding that would pin every layer's
    gathered, quantized weight on every rank between micro-batches (the full model per rank, which
    resharding exists to avoid; each re-gather would miss the cache anyway), so sharded layers quantize
    per forward instead (same bits). Without resharding the weights stay gathered for the step and
    every layer's Q(W) is alive from its forward to its backward anyway: keeping it costs no peak."""

    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.cache_weight = False


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (an all-gather: every rank must call it in the same order)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class GatheredWeights(Mapping):
    """Read-only HF-named view of a (sharded) model's state_dict whose values are gathered on access.

    A read all-gathers that one tensor; only the last one read is kept, so the extra memory is one
    tensor. `shards` is the same names un-gathered (DTensors: global shape and dtype, no data moved),
    for checks that need no values, so a refit gathers each tensor once. All ranks must read the
    same keys in the same order, as a refit does.
    """

    def __init__(self, model: nn.Module) -> None:
        self._state = model.state_dict()  # DTensor shards: no copy of the model
        self._last: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._last is None or self._last[0] != name:
            self._last = (name, full_tensor(self._state[name].detach()))
        return self._last[1]

    @property
    def shards(self) -> Mapping[str, torch.Tensor]:
        """The un-gathered DTensors by name: `.shape` is the full shape, `.dtype` the dtype; reading
        one moves no data."""
        return self._state

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)
