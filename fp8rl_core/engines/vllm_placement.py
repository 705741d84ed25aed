"""Where vLLM engines run on a cell of W ranks: one engine per rank, on that rank's GPU or CPU (pure; no vLLM import).

Placement (world size W > 1, vLLM 0.32; re-read for 0.32 in the files named here): every rank runs its own
in-process `vllm.LLM` with
`distributed_executor_backend="external_launcher"`. Its executor (v1/executor/uniproc_executor.py,
ExecutorWithExternalLauncher._distributed_args) takes rank and device from RANK / LOCAL_RANK, and the
GPU worker (v1/worker/gpu_worker.py, Worker.init_device) makes cuda:LOCAL_RANK current. The default
`uni` executor takes its device index from DeviceConfig.device ("cuda": index 0), so every rank's engine
and then every rank's FSDP2 shards would land on GPU 0. vLLM's world with this backend is
TP x PP x DP (config/parallel.py, ParallelConfig.__post_init__) and joins the torch.distributed group
that is already up (distributed/parallel_state.py, init_distributed_environment: no second init);
initialize_model_parallel lays the torch world out as ExternalDP x DP x PP x PCP x TP, where "every
ExternalDP rank can generate independently" while "all the ranks in the same DP group should generate
simultaneously ... otherwise it will cause deadlock". We map W ranks at TP = 1 to W ExternalDP
replicas: tensor_parallel_size = pipeline_parallel_size = data_parallel_size = 1 per engine. vLLM's
own DP (data_parallel_size = W) is the wrong fit: with external_launcher and DP > 1 its LLMEngine
all-reduces "has unfinished requests" over the DP group at every step (v1/engine/llm_engine.py,
has_unfinished_requests_dp), so every generate would be a collective, while our ranks generate
different GRPO groups and validation generates on rank 0 alone. TP > 1 at W > 1 is refused: the ranks of
a TP group must send identical prompts and seeds (ExecutorWithExternalLauncher's docstring), which our
data-parallel split by whole GRPO groups does not do. At W = 1 nothing is set (vLLM's `uni` executor,
or `mp` for TP > 1, as before). On a CPU the same backend runs vLLM's CPUWorker (v1/worker/cpu_worker.py, a
subclass of the GPU worker) over gloo, joining our gloo group (tests/fp8rl_core/engines/test_vllm_real.py
runs two ranks); the device checks below are CUDA's only.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

EXTERNAL_LAUNCHER = "external_launcher"  # vLLM's torchrun-style backend: one engine per rank, in-process


def placement_kwargs(world_size: int, tensor_parallel_size: int) -> dict[str, Any]:
    """The `vllm.LLM` arguments that put one engine on each of `world_size` ranks (module docstring,
    "Placement"): {} at world size 1; external_launcher with TP = PP = DP = 1 above it. Raises ValueError
    for a layout it cannot run, with the reason."""
    if world_size <= 1:
        return {}
    if tensor_parallel_size != 1:
        raise ValueError(
            f"engines.vllm.tensor_parallel_size={tensor_parallel_size} at world size {world_size}: with vLLM's "
            "external_launcher the ranks of one tensor-parallel group must generate the same prompts with the same "
            "seeds, but every rank generates its own GRPO groups (and validation runs on rank 0 alone); valid: 1 "
            "(one engine per rank, each its own replica), or world size 1")
    return {"distributed_executor_backend": EXTERNAL_LAUNCHER, "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1, "data_parallel_size": 1}


def rank_env_error(env: Mapping[str, str], rank: int, local_rank: int, world_size: int,
                   device_count: int) -> str | None:
    """Why an external_launcher engine cannot start on this rank, or None. vLLM reads RANK and LOCAL_RANK
    from the environment (ExecutorWithExternalLauncher._distributed_args) and asserts LOCAL_RANK < the
    visible device count (Worker.init_device); they must be this rank's (the mesh's) values."""
    if world_size <= 1:
        return None
    got = {k: env.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    want = {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size)}
    bad = [f"{k}={got[k]!r} (this rank: {want[k]})" for k in want if got[k] != want[k]]
    if bad:
        return ("vLLM's external_launcher reads the rank from the environment, which disagrees with the process "
                "group: " + ", ".join(bad) + "; launch with torchrun or a multi-task SLURM job "
                "(fp8rl_core/distributed/env.py exports them)")
    if local_rank >= device_count:
        return (f"LOCAL_RANK={local_rank} but this process sees {device_count} CUDA device(s): one rank per GPU "
                "needs every GPU of the node visible to every rank (do not bind CUDA_VISIBLE_DEVICES per task)")
    return None
