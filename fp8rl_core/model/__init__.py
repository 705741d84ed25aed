"""The policy model (Llama / Qwen2 architecture with HF's names) and its HF checkpoint I/O."""
from fp8rl_core.model.config import PRESETS, ModelConfig, preset
from fp8rl_core.model.fp8_policy import apply_fp8
from fp8rl_core.model.hf_io import load_pretrained, save_pretrained
from fp8rl_core.model.llama import CausalLM, build_model

__all__ = [
    "PRESETS",
    "CausalLM",
    "ModelConfig",
    "apply_fp8",
    "build_model",
    "load_pretrained",
    "preset",
    "save_pretrained",
]
