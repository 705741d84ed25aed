"""The models the device check runs: random-init Llamas (no warm start: speed, memory and numerics only).

`policy`: the GRPO phase's ~1B Llama on a GPU (TinyLlama's shape: hidden 2048, 22 layers, 32 heads,
4 KV heads, SwiGLU 5632; the arithmetic task's 32-token vocabulary, so ~0.97 B parameters, nearly all
in the linear layers FP8 quantizes), two layers at hidden 256 with --cpu. `block_model`: the FSDP2 and
Megatron phases' smaller Llama (8 layers at hidden 1024 on a GPU). The preflight checks the policy's shapes.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any


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
