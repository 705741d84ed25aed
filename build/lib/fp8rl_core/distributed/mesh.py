"""The one object that says where this process stands in a cell: world size, rank, device mesh, reductions.

    mesh = init_distributed(timeout_s=1800, device="cpu")    # fp8rl_core/distributed/env.py
    n_global = mesh.all_reduce_sum([n_local])[0]
    if mesh.is_rank0: sink.log(step, metrics)

World size 1 (the default, and every laptop run) is `SINGLE`: no process group, and every reduction
returns its input unchanged without touching torch.distributed, so a single process pays nothing.
Reductions run in float64 on the CPU (gloo) whatever the training device: they carry per-step scalars
(token counts, metric sums), never tensors of the model's size.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Mesh:
    """world_size ranks on a 1-D data-parallel mesh ("dp"); FSDP2 shards over the same ranks.

    device_mesh: a torch DeviceMesh over all ranks, None at world size 1.
    local_rank:  the rank within its node (the CUDA device index on GPU nodes).
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    device_mesh: Any = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_rank0(self) -> bool:
        """Rank 0 alone writes the run's files and talks to MLflow."""
        return self.rank == 0

    def shard(self, n: int, what: str = "items") -> range:
        """This rank's contiguous share of n items, n / world_size of them (rank r: [r n/W, (r+1) n/W)).

        Contiguous shares keep ranks' rows in the single-process order once concatenated by rank.
        Raises ValueError when n is not a multiple of world_size.
        """
        if n % self.world_size:
            raise ValueError(f"{n} {what} cannot be split evenly over {self.world_size} ranks")
        k = n // self.world_size
        return range(self.rank * k, (self.rank + 1) * k)

    def all_reduce_sum(self, values: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """Float64[k]: the element-wise sum of `values` over ranks (one collective for all k)."""
        return self._reduce(values, "sum")

    def all_reduce_max(self, values: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """Float64[k]: the element-wise max of `values` over ranks."""
        return self._reduce(values, "max")

    def _reduce(self, values: Sequence[float] | torch.Tensor, op: str) -> torch.Tensor:
        t = torch.as_tensor(values, dtype=torch.float64).detach().reshape(-1).cpu().clone()
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()


SINGLE = Mesh()  # world size 1: no process group


def is_rank0(mesh: Mesh | None) -> bool:
    return mesh is None or mesh.is_rank0


def all_reduce_sum(mesh: Mesh | None, values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Module-level helper: `mesh.all_reduce_sum(values)`, identity when mesh is None."""
    return (mesh or SINGLE).all_reduce_sum(values)
