"""Local Hugging Face checkpoints <-> our model: `config.json` + safetensors, nothing from a hub.

Load: a single `model.safetensors`, or shards listed by `model.safetensors.index.json`; BF16/FP16/FP32
weights, or block-FP8 ones (E4M3 `weight` + FP32 `weight_scale_inv` [ceil(out/br), ceil(in/bc)],
DeepSeek-V3 / vLLM format), dequantized on load: w = q.float() * scale per block.
Save: `config.json` (HF format) + `model.safetensors` (+ `tokenizer.json`), each written to a
temporary name, fsynced, then renamed, config last, so that a folder with a config.json is complete.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fp8rl_core.fp8 import dequantize_blockwise, quantize_blockwise
from fp8rl_core.io.atomic import fsync_dir, fsync_file
from fp8rl_core.model.config import ModelConfig, merge_eos_ids
from fp8rl_core.model.llama import CausalLM

CONFIG, WEIGHTS, INDEX, TOKENIZER = "config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
GENERATION_CONFIG = "generation_config.json"  # HF's sampling defaults; may list more EOS ids than config.json
FP8_BLOCK = (128, 128)
# The `quantization_config` of a block-FP8 checkpoint (DeepSeek-V3 / vLLM / transformers' fp8 method)
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(FP8_BLOCK)}
SCALE_SUFFIX = "_scale_inv"  # `x.weight_scale_inv` is the dequantization multiplier of `x.weight`
IGNORED_KEYS = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; we compute RoPE on the fly


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> CausalLM:
    """Our model with the weights of the HF checkpoint folder `path`, parameters in `dtype`."""
    path = Path(path)
    hf = read_hf_config(path)
    cfg = model_config_of(hf, path)
    state = dequantize_state(read_safetensors(path), fp8_block_of(hf, path), path)
    with torch.device("meta"):
        model = CausalLM(cfg)  # no memory, no init: every tensor comes from the checkpoint
    expected = model.state_dict()
    state = {k: v for k, v in state.items() if not k.endswith(IGNORED_KEYS)}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # HF also ignores a stored head when the config ties it
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    check_keys(state, expected, path)
    model.load_state_dict({k: v.to(dtype).contiguous() for k, v in state.items()}, strict=True, assign=True)
    model.tie_weights()
    return model.to(device) if device is not None else model


def read_hf_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no config.json; expected a local Hugging Face checkpoint folder")
    return json.loads(file.read_text())


def read_generation_config(path: Path) -> dict[str, Any]:
    """generation_config.json of a checkpoint folder, or {} when it has none."""
    file = Path(path) / GENERATION_CONFIG
    return json.loads(file.read_text()) if file.is_file() else {}


def model_config_of(hf: dict[str, Any], path: Path) -> ModelConfig:
    """ModelConfig of a checkpoint folder's config.json dict, its EOS ids merged with generation_config.json's
    (Qwen2.5-Instruct's turn end 151645 is only there; Llama-3.1-Instruct lists 128001, 128008, 128009)."""
    eos = merge_eos_ids(hf, read_generation_config(path))
    return ModelConfig.from_hf_dict({**hf, "eos_token_id": eos})


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a local HF checkpoint folder (config.json + generation_config.json's EOS ids)."""
    path = Path(path)
    return model_config_of(read_hf_config(path), path)


def fp8_block_of(hf: dict[str, Any], path: Path) -> tuple[int, int] | None:
    """The weight block of a block-FP8 checkpoint's quantization_config, or None if unquantized."""
    q = hf.get("quantization_config")
    if not q:
        return None
    where = f"{path / CONFIG}: quantization_config"
    if q.get("quant_method") != "fp8":
        raise ValueError(f"{where}.quant_method: {q.get('quant_method')!r} not supported; valid: fp8")
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{where}: need fmt e4m3 and activation_scheme dynamic, got "
                         f"{q.get('fmt')!r} / {q.get('activation_scheme')!r}")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2):
        raise ValueError(f"{where}.weight_block_size: expected [rows, cols] like [128, 128], got {block!r}")
    return int(block[0]), int(block[1])


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint: model.safetensors, else the shards its index lists, else *.safetensors."""
    if (path / WEIGHTS).is_file():
        files = [path / WEIGHTS]
    elif (path / INDEX).is_file():
        weight_map: dict[str, str] = json.loads((path / INDEX).read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path}: no {WEIGHTS}, {INDEX} or *.safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        part = load_file(str(file), device="cpu")
        clash = tensors.keys() & part.keys()
        if clash:
            raise ValueError(f"{file}: tensors {sorted(clash)[:3]} also appear in another shard")
        tensors.update(part)
    return tensors


def dequantize_state(tensors: dict[str, torch.Tensor], block: tuple[int, int] | None,
                     path: Path) -> dict[str, torch.Tensor]:
    """Replace every (E4M3 `weight`, `weight_scale_inv`) pair by its FP32 dequantization."""
    scales = [k for k in tensors if k.endswith(SCALE_SUFFIX)]
    if scales and block is None:
        raise ValueError(f"{path}: {scales[0]} present but config.json has no quantization_config")
    if any(k.endswith("activation_scale") for k in tensors):
        raise ValueError(f"{path}: static activation scales are not supported (need activation_scheme dynamic)")
    if not scales:
        return tensors

    out = dict(tensors)
    for key in scales:
        name = key[: -len(SCALE_SUFFIX)]
        q, scale = out.pop(name, None), out.pop(key)
        if q is None or q.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{path}: {key} needs an E4M3 tensor {name}, got "
                             f"{'nothing' if q is None else q.dtype}")
        out[name] = dequantize_blockwise(q, scale.float(), block)
    return out


def check_keys(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], path: Path) -> None:
    """Raise naming the missing, unexpected or wrongly shaped tensors."""
    missing = sorted(k for k in expected if state.get(k) is None)
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match config.json: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}")
    for key, ref in expected.items():
        if tuple(state[key].shape) != tuple(ref.shape):
            raise ValueError(f"{path}: {key} has shape {tuple(state[key].shape)}, config.json implies "
                             f"{tuple(ref.shape)}")


def save_pretrained(model: CausalLM, path: str | Path, quantization: str | None = None,
                    ignore: Iterable[str] = ("lm_head",), dtype: torch.dtype | None = None,
                    tokenizer: Any = None) -> Path:
    """Write `model` as an HF checkpoint folder (created if needed); returns the folder.

    quantization: None, or "fp8_block": every linear weight whose module name matches no fnmatch
      pattern of `ignore` is stored as E4M3 + `weight_scale_inv` with [128, 128] blocks (a tied
      lm_head is never quantized; embeddings, norms and biases never are).
    dtype: cast floating tensors that are not quantized to this dtype (None: as they are).
    tokenizer: optional; a `tokenizers.Tokenizer`, or an object with `save(folder)` such as
      fp8rl_core.model.tokenizer.Tokenizer.
    """
    if quantization not in (None, "fp8_block"):
        raise ValueError(f"quantization: {quantization!r} not supported; valid: None, 'fp8_block'")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if (path / INDEX).exists():
        raise FileExistsError(f"{path / INDEX}: a sharded checkpoint is already there; save to a fresh folder")
    cfg: ModelConfig = model.config
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")  # safetensors stores no aliases; HF re-ties on load
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = str(state["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    if quantization == "fp8_block":
        kept = quantize_linears(model, state, tuple(ignore))
        hf["quantization_config"] = {**FP8_BLOCK_CONFIG, "modules_to_not_convert": kept}
    _atomic_write(path / WEIGHTS, lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}))
    if tokenizer is not None:
        _save_tokenizer(tokenizer, path)
    _atomic_write(path / CONFIG, lambda tmp: tmp.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n"))
    fsync_dir(path)
    return path


def linear_module_names(model: nn.Module) -> list[str]:
    """Names of the modules whose `weight` is a linear layer's (nn.Linear or Fp8Linear)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Fp8Linear"]


def quantize_linears(model: CausalLM, state: dict[str, torch.Tensor], ignore: tuple[str, ...]) -> list[str]:
    """Quantize, in `state`, the linear weights not matched by `ignore`; return the kept module names."""

    kept = []
    for name in linear_module_names(model):
        tied_head = name == "lm_head" and model.config.tie_word_embeddings
        if tied_head or any(fnmatch(name, pat) for pat in ignore):
            kept.append(name)
            continue
        q, scale = quantize_blockwise(state[f"{name}.weight"].float(), FP8_BLOCK)
        state[f"{name}.weight"], state[f"{name}.weight{SCALE_SUFFIX}"] = q, scale.float()
    return kept


def _save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """A raw `tokenizers.Tokenizer` (to_str) is written atomically as tokenizer.json; anything else
    with `save(folder)` (fp8rl_core.model.tokenizer.Tokenizer: tokenizer.json + tokenizer_config.json)
    writes itself, before config.json marks the folder complete."""
    if hasattr(tokenizer, "to_str"):
        _atomic_write(folder / TOKENIZER, lambda tmp: tmp.write_text(tokenizer.to_str()))
    elif hasattr(tokenizer, "save"):
        tokenizer.save(folder)
    else:
        raise TypeError(f"tokenizer: {type(tokenizer).__name__} has neither to_str() nor save(folder)")


def _atomic_write(final: Path, write) -> None:
    """write(tmp) to a temporary sibling, fsync it, then rename over `final` (atomic on POSIX)."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fsync_file(tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
