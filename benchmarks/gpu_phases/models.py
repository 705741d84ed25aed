"""The models the device check runs: random-init Llamas (no warm start: speed, memory and numerics only).

`policy`: the GRPO phase's ~1B Llama on a GPU (TinyLlama's shape: hidden 2048, 22 layers, 32 heads,
4 KV heads, SwiGLU 5632; the arithmetic task's 32-token vocabulary, so ~0.97 B parameters, nearly all
in the linear layers FP8 quantizes), two layers at hidden 256 with --cpu. `block_model`: the FSDP2 and
Megatron phases' smaller Llama (8 layers at hidden 1024 on a GPU). The preflight checks the policy's shapes,
and `plan_shapes` the FP8 GEMM shapes of the 8B cluster sweep (Llama-3.1-8B from its architecture alone).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SWEEP_8B = "sweeps/fp8_ablation_llama8b.yaml"
# Llama-3.1-8B-Instruct's config.json, its architecture only: the lent machine has no checkpoint and no network
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}


def policy(cpu: bool) -> Any:
    from fp8rl_core.model import ModelConfig

    if cpu:
        return ModelConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2)
    return ModelConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                       num_key_value_heads=4, max_position_embeddings=2048)


def block_model(cpu: bool) -> Any:
    from fp8rl_core.model import ModelConfig

    if cpu:
        return ModelConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2)
    return ModelConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=4, max_position_embeddings=2048)


def random_checkpoint(cfg: Any, path: Path, device: Any, seed: int = 0) -> tuple[Path, int, float]:
    """Write a random-init HF checkpoint of `cfg` (BF16 on disk) to `path`: (path, parameters, seconds).
    Initialised on `device` (a 1B model's init on the host CPU alone takes longer than the whole step)."""
    import torch

    from fp8rl_core.model.hf_io import save_pretrained
    from fp8rl_core.model.llama import CausalLM, init_weights

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    with torch.device(device):
        model = CausalLM(cfg)
        init_weights(model)
    n = sum(p.numel() for p in model.parameters())
    save_pretrained(model.to(torch.bfloat16), path)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return path, n, time.perf_counter() - t0


def plan_shapes(work: Path, cpu: bool) -> tuple[list[Any], str]:
    """(shapes, what they are): the distinct FP8 GEMM shapes that the cells of the 8B sweep (SWEEP_8B) check
    before their first step, as `sweep plan --preflight` lists them (launchers/plan/preflight.py: each cell's
    fp8rl_core.loop.builder.preflight_shapes, at the sweep's M values, on its 8 ranks), from LLAMA_8B's
    architecture. --cpu: the same sweep and code on the tiny policy's architecture (hidden 256), each distinct
    (pass, K, N) at `sweep plan`'s CPU M (preflight.PLAN_CPU_MS), as `sweep plan --preflight` checks on a CPU."""
    from launchers.plan.grid import expand
    from launchers.plan.preflight import cell_shapes, to_check
    from launchers.sweepfile.loading import load_sweep

    arch = policy(True).to_hf_dict() if cpu else LLAMA_8B
    model = work / ("policy-config" if cpu else "Llama-3.1-8B-config")
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(arch))
    sweep = load_sweep(ROOT / SWEEP_8B, [f"base.model.path={model}"], cwd=ROOT)
    cells = expand(sweep)
    listed = [(cell, cell_shapes(sweep, cell)[0]) for cell in cells]
    groups = [shapes for _, shapes in listed if shapes]
    recipes = sorted({cell.config.recipe for cell, shapes in listed if shapes})
    what = (f"{SWEEP_8B}: the cells of {', '.join(recipes) or 'no recipe'} ({sum(bool(s) for _, s in listed)} of "
            f"{len(cells)} cells; the others run no FP8 GEMM of ours), {sweep.launcher.world_size} ranks, "
            + ("the tiny policy's architecture at the CPU's M (--cpu)" if cpu else "Llama-3.1-8B"))
    return to_check(groups, on_gpu=not cpu), what
