"""Run a function on W real ranks (torch.multiprocessing spawn, gloo on the CPU, 1 thread per rank).

    results = run_ranks(2, worker, arg1, arg2)   # worker(mesh, *args) -> picklable, once per rank

Each rank joins the process group through fp8rl_core.distributed.init_distributed from the same
environment variables torchrun sets; world size 1 runs in a spawned process too, so that every world
size runs under the same threads and the same code path into the engine.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from fp8rl_core.io.ports import free_port


def _entry(rank: int, world: int, port: int, fn, args: tuple, out: str, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from fp8rl_core.distributed import init_distributed, shutdown

    mesh = init_distributed(timeout_s=timeout_s, device_type="cpu")
    clean = False
    try:
        result = fn(mesh, *args)
        clean = True
    finally:
        shutdown(mesh, clean=clean)
    torch.save(result, Path(out) / f"rank{rank}.pt")


def run_ranks(world: int, fn, *args, timeout_s: float = 120.0) -> list:
    """fn(mesh, *args) on `world` ranks (collective timeout `timeout_s`); returns the per-rank results."""
    with tempfile.TemporaryDirectory(dir="/tmp") as out:
        mp.spawn(_entry, args=(world, free_port(), fn, args, out, timeout_s), nprocs=world, join=True)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
