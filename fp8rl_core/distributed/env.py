"""Join the cell's process group from the launcher's environment: torchrun, or a multi-task SLURM job.

    torchrun --standalone --nproc-per-node 2 -m fp8rl_core.cli ...   # RANK, WORLD_SIZE, MASTER_* set
    srun / submitit with tasks_per_node > 1                           # SLURM_* set; submitit exports them

Backends: gloo on the CPU; on CUDA "cpu:gloo,cuda:nccl" (NCCL for the model's collectives, gloo for
the small CPU reductions of metrics). The collective timeout (`distributed.timeout_s`) turns a dead or
stuck rank into a failed job (every other rank raises) instead of a hang.
"""
from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from fp8rl_core.distributed.mesh import SINGLE, Mesh

_OWNED = False  # True once this module created the process group (then shutdown() destroys it)


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    source: str  # "single", "torchrun" (RANK/WORLD_SIZE already set) or "slurm"


def detect_rank_env(environ: Mapping[str, str] | None = None) -> RankEnv:
    """Where this process stands, from environment variables only (nothing is initialized)."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or submitit's export() done before us
        return RankEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)), "torchrun")
    # A SLURM job step with several tasks; SLURM_NTASKS=1 (every single-process cell) stays single.
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return RankEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                       "slurm")
    return RankEnv(0, 1, 0, "single")


# Rendezvous ports below Linux's ephemeral range (32768-60999 by default): submitit's own choice, a
# random port in 20000-60000, can collide with a client socket the node opened a moment before (seen:
# EADDRINUSE on a retried cell's first rank).
PORT_LOW, PORT_SPAN = 20000, 12000


def master_port(job_id: str) -> int:
    """The job's rendezvous port: the same on every task of the job (derived from its id), 20000-31999."""
    return PORT_LOW + zlib.crc32(job_id.encode()) % PORT_SPAN


def _export_slurm() -> None:
    """MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK from the SLURM job (submitit's helper); the port
    is `master_port(job id)` unless the job's environment sets MASTER_PORT."""
    from submitit.helpers import TorchDistributedEnvironment

    dist_env = TorchDistributedEnvironment()  # reads MASTER_PORT when the job sets it
    if "MASTER_PORT" not in os.environ and "SLURM_JOB_ID" in os.environ:
        dist_env.master_port = master_port(os.environ["SLURM_JOB_ID"])
    # overwrite: export refuses any variable already set, and a user's MASTER_PORT is kept above anyway
    dist_env.export(set_cuda_visible_devices=False, overwrite=True)


def init_distributed(timeout_s: float = 1800.0, device_type: str = "cpu") -> Mesh:
    """The Mesh of this process; initializes torch.distributed unless world size is 1.

    Reuses a process group that is already initialized (a test harness, a caller that owns it).
    device_type: "cpu" or "cuda" (then each rank takes cuda:local_rank).
    """
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _mesh(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), device_type)
    env = detect_rank_env()
    if env.world_size == 1:
        return SINGLE
    if env.source == "slurm":
        _export_slurm()
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout_s))
    global _OWNED
    _OWNED = True
    return _mesh(env.rank, env.world_size, env.local_rank, device_type)


def _mesh(rank: int, world_size: int, local_rank: int, device_type: str) -> Mesh:
    if world_size == 1:
        return SINGLE
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    return Mesh(world_size=world_size, rank=rank, local_rank=local_rank, device_mesh=device_mesh)


def shutdown(mesh: Mesh, clean: bool = True) -> None:
    """Destroy the process group if init_distributed created it (no-op at world size 1 or when the
    caller owns the group).

    clean: every rank got here without an error, so all meet at a barrier first. Without it a rank
    that closes its gloo connections while a peer is still finishing its last collective can abort
    that peer (SIGABRT, "terminate called without an active exception"). After an error there is no
    barrier: the peers may never arrive, and this rank must not wait out the collective timeout. A
    barrier that fails (a peer's connection already broken) is no reason to keep the group alive.
    """
    import torch.distributed as dist

    global _OWNED
    if mesh.distributed and _OWNED and dist.is_initialized():
        if clean:
            with contextlib.suppress(RuntimeError):
                dist.barrier()
        dist.destroy_process_group()
        _OWNED = False
