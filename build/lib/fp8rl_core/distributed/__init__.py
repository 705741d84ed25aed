"""Scale-out of one cell over torch.distributed ranks (docs/design.md "Scale-out").

env.py: join the process group (torchrun / SLURM); mesh.py: the Mesh (rank, world size, reductions);
parallel.py: FSDP2 sharding and activation checkpointing of the policy, gathering of full weights.
"""
from fp8rl_core.distributed.env import detect_rank_env, init_distributed, shutdown
from fp8rl_core.distributed.mesh import SINGLE, Mesh, all_reduce_sum, is_rank0

__all__ = ["SINGLE", "Mesh", "all_reduce_sum", "detect_rank_env", "init_distributed", "is_rank0", "shutdown"]
