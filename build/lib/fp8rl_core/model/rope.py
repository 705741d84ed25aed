"""RoPE frequencies, including the context-extension scalings of Hugging Face's `rope_scaling`.

    inv_freq_j = 1 / theta^(2j / head_dim),  j < head_dim / 2     ("default": plain RoPE)

Scalings (config.json `rope_scaling`, or transformers >= 5's `rope_parameters`), as
transformers' ROPE_INIT_FUNCTIONS compute them (FP32, the same operations in the same order, so our
frequencies are bitwise HF's):
- "linear" {factor}: inv_freq / factor (position interpolation);
- "llama3" {factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}
  (Llama-3.1/3.2: factor 8, 1, 4, 8192): wavelengths 2*pi/inv_freq longer than
  original / low_freq_factor are divided by factor, shorter than original / high_freq_factor kept,
  and those in between interpolated with s = (original / wavelen - low) / (high - low):
  (1 - s) * inv_freq / factor + s * inv_freq.
Both leave the attention scaling at 1, so cos/sin are those of plain RoPE with these frequencies.

Not supported, refused by `normalize_rope_scaling` with the reason: "dynamic" (NTK-aware scaling whose
base depends on the current sequence length: transformers recomputes it per forward from the batch's
longest position, vLLM fixes it once from max_position_embeddings x factor, so a generation and a
training engine would disagree), "yarn" and "longrope" (attention scaling and per-dimension factors
that neither engine implements), and any other rope_type.

The training engine (model/layers.py) and the generation engine (engines/native_gen.py) share these
frequencies (a config fact, not a kernel); each still builds its own cos/sin its own way.
"""
from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3")
# keys each supported rope_type needs (besides rope_type), and the ones it may carry
REQUIRED = {"default": (), "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
IGNORED_KEYS = ("rope_theta", "type", "rope_type", "partial_rotary_factor")
REFUSED = {
    "dynamic": "its base depends on the sequence length (transformers recomputes it per forward from the "
               "batch, vLLM fixes it from max_position_embeddings x factor): the engines would disagree",
    "yarn": "its attention scaling and per-dimension ramp are not implemented by our engines",
    "longrope": "its per-dimension factors are not implemented by our engines",
}


def normalize_rope_scaling(scaling: Any, where: str = "rope_scaling") -> dict[str, Any] | None:
    """A validated copy `{rope_type, <its keys>}` of an HF rope_scaling / rope_parameters dict, or None
    for plain RoPE (None, {}, or rope_type "default"). Raises ValueError naming the key and what is allowed.
    `rope_theta` inside the dict is not kept here (it is ModelConfig.rope_theta)."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: expected a mapping like {{rope_type: llama3, factor: 8.0, ...}} or null, "
                         f"got {type(scaling).__name__}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in REFUSED:
        raise ValueError(f"{where}.rope_type: {rope_type!r} is not supported ({REFUSED[rope_type]}); "
                         f"valid: {', '.join(ROPE_TYPES)}")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}.rope_type: {rope_type!r} is not supported; valid: {', '.join(ROPE_TYPES)}")
    partial = scaling.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"{where}.partial_rotary_factor: {partial!r} is not supported; valid: 1.0 (RoPE over "
                         "the whole head_dim)")
    if rope_type == "default":
        return None
    out: dict[str, Any] = {"rope_type": rope_type}
    for key in REQUIRED[rope_type]:
        if key not in scaling:
            raise ValueError(f"{where}.{key}: required for rope_type {rope_type!r} "
                             f"(needs {', '.join(REQUIRED[rope_type])})")
        value = scaling[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{where}.{key}: must be a number > 0, got {value!r}")
        out[key] = int(value) if key == "original_max_position_embeddings" else float(value)
    if rope_type == "llama3" and not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError(f"{where}.high_freq_factor: must be > low_freq_factor, got "
                         f"{out['high_freq_factor']} <= {out['low_freq_factor']}")
    unknown = sorted(set(scaling) - set(out) - set(IGNORED_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} for rope_type {rope_type!r}; valid: "
                         f"{', '.join(('rope_type', *REQUIRED[rope_type]))}")
    return out


def inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
             device: torch.device | str | None = None) -> torch.Tensor:
    """Float32[head_dim / 2]: the RoPE inverse frequencies (see the module docstring)."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    if scaling is None:
        return base
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return base / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / factor, base)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
