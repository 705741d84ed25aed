"""Atomic, resumable run checkpoints on shared disks.

Layout: `<dir>/step_00000010/{weights.safetensors, state.pt, meta.json}`. A checkpoint is written
into `<dir>/.tmp-step_..-<pid>`, every file fsynced, then the folder is renamed into place (atomic on
POSIX): a kill at any instant leaves the previous checkpoint intact and never a half-written one
under a real name. Weights are safetensors (no code execution on load); everything else is loaded
with `torch.load(weights_only=True)` because other people can write these folders.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fp8rl_core.atomic import fsync_dir, fsync_file

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def save_checkpoint(root: str | Path, step: int, weights: dict[str, torch.Tensor], state: dict[str, Any],
                    meta: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically; keep the newest `keep` checkpoints. Returns its folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / "weights.safetensors"))
    torch.save(state, tmp / "state.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, **(meta or {})}, indent=1))
    for f in tmp.iterdir():
        fsync_file(f)
    fsync_dir(tmp)
    if final.exists():  # a re-run of the same step (e.g. after a requeue): replace it atomically
        old = root / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_dir(root)
    for stale in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)
             and (p / "meta.json").exists()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def load_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights, state, meta) of one checkpoint folder."""
    path = Path(path)
    weights = load_file(str(path / "weights.safetensors"))
    state = torch.load(path / "state.pt", weights_only=True)
    meta = json.loads((path / "meta.json").read_text())
    return weights, state, meta


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None
