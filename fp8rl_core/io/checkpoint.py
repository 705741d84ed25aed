"""Sharded, atomic, resumable run checkpoints (torch.distributed.checkpoint, DCP) on shared disks.

Layout of one checkpoint (every rank of the run writes into it; the model is stored once):

    <root>/step_00000010/
        .metadata  __0_0.distcp  __1_0.distcp ...   DCP: model, optimizer and engine step, each rank
                                                    writing its own shards (plain tensors at world size 1)
        rank_00000.pt  rank_00001.pt ...            each rank's RNG and data state (no weights)
        config.json                                 the model's HF config, so that `export` needs nothing else
        meta.json                                   step, world_size, format; written last

Atomicity: every rank writes into `<root>/.tmp-step_00000010`; after a barrier rank 0 fsyncs,
renames it to `step_00000010` (atomic on POSIX) and prunes old ones. A kill at any instant leaves
the previous checkpoint intact, and a half-written folder never carries a real name.

Resharding: DCP stores each tensor's global shape and the chunks each rank wrote, so a checkpoint
written by FSDP2 at world size 2 loads into world size 1 (plain module) or 4 (other shards).

Safety (other people can write these folders): DCP's own reader unpickles `.metadata` and
`torch.load(weights_only=False)`s non-tensor values; `_SafeReader`/`_SafePlanner` replace both
with an allow-list unpickler and `weights_only=True`. Per-rank files: `torch.load(weights_only=True)`.

Exporting one of these folders as an HF checkpoint is the entry point fp8rl_core/checkpoint.py
(`python -m fp8rl_core.checkpoint export ...`): it needs the model, which this module does not.
"""
from __future__ import annotations

import contextlib
import io
import json
import pickle
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # private, as DefaultLoadPlanner.load_bytes uses it
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fp8rl_core.io.atomic import fsync_dir, fsync_file

FORMAT = "dcp-v1"
TRAIN_KEY = "train"  # the DCP key of the training engine's state (its tensors are "train.model.<fqn>", ...)
_STEP_DIR = re.compile(r"^step_(\d{8})$")


# --- ranks (world size 1 needs no process group) ---------------------------------------------------

def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every save/load without a process group; at world size 1 that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# --- the training engine as a DCP Stateful -----------------------------------------------------------

class EngineState:
    """DCP `Stateful` view of a training engine.

    An engine with `model` (nn.Module) and `optimizer` goes through torch's state-dict API
    (`get_state_dict/set_state_dict`): FQN keys, local shards as DTensors under FSDP2, plain tensors
    otherwise, so one checkpoint serves every world size. Other engines (Megatron-Core) use their own
    `state_dict()/load_state_dict()` (HF-named tensors), loaded in place by DCP.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.native = isinstance(getattr(engine, "model", None), torch.nn.Module) and \
            isinstance(getattr(engine, "optimizer", None), torch.optim.Optimizer)

    def state_dict(self) -> dict[str, Any]:
        if not self.native:
            return self.engine.state_dict()
        # On a fresh optimizer this initialises AdamW's state (one step at lr 0, weights unchanged),
        # so that the load has tensors to fill in place.
        model_sd, optim_sd = get_state_dict(self.engine.model, self.engine.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": int(self.engine.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.native:
            self.engine.load_state_dict(state)
            return
        set_state_dict(self.engine.model, self.engine.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.engine.step = int(state["step"])


# --- safe DCP reading --------------------------------------------------------------------------------

_META_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "MetadataIndex", "StorageMeta"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` but no other class or function: a crafted file cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _META_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint .metadata: {module}.{name} is not allowed in a DCP metadata file")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner, but non-tensor values are read with torch.load(weights_only=True)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


# --- save ----------------------------------------------------------------------------------------------

def save_checkpoint(root: str | Path, step: int, state: dict[str, Any], rank_state: dict[str, Any],
                    meta: dict[str, Any] | None = None, model_config: dict[str, Any] | None = None,
                    keep: int = 2) -> Path:
    """Write checkpoint `step` atomically; keep the newest `keep`. Collective: every rank calls it.

    state: the DCP app state, e.g. {"train": EngineState(engine)} (tensors, or Statefuls).
    rank_state: this rank's non-tensor state (RNG, data position): ints, tuples, tensors.
    Returns the final folder (the same path on every rank).
    """
    root = Path(root)
    final, tmp = root / f"step_{step:08d}", root / f".tmp-step_{step:08d}"
    if _rank() == 0:  # a stale temporary folder of this step (a kill mid-save) is garbage
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    with _quiet():
        dcp.save(state, checkpoint_id=tmp, no_dist=not dist.is_initialized())
    _write_rank_state(tmp, rank_state)
    _barrier()  # every rank's shards and rank file are on disk
    if _rank() == 0:
        _seal(tmp, final, {"step": step, "format": FORMAT, "world_size": _world_size(), **(meta or {})},
              model_config)
        for stale in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()  # nobody reads `latest_checkpoint` before the rename
    return final


def _write_rank_state(folder: Path, rank_state: dict[str, Any]) -> None:
    path = folder / f"rank_{_rank():05d}.pt"
    torch.save(rank_state, path)
    fsync_file(path)  # on this rank's node: rank 0 cannot fsync another node's writes


def _seal(tmp: Path, final: Path, meta: dict[str, Any], model_config: dict[str, Any] | None) -> None:
    """Rank 0: config + meta.json into `tmp`, fsync, rename to `final` (replacing a same-step one)."""
    if model_config is not None:
        (tmp / "config.json").write_text(json.dumps(model_config, indent=1))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    for f in tmp.iterdir():
        fsync_file(f)
    fsync_dir(tmp)
    if final.exists():  # a re-run of the same step (after a requeue): swap it in atomically
        old = final.parent / f".old-{final.name}"
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    fsync_dir(final.parent)


# --- find and load ---------------------------------------------------------------------------------------

def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders are never listed)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / "meta.json").exists()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / "meta.json").read_text())


def is_legacy(path: str | Path) -> bool:
    """The pre-DCP format: weights.safetensors + state.pt (world size 1 only)."""
    return (Path(path) / "state.pt").exists() and not (Path(path) / ".metadata").exists()


def load_checkpoint(path: str | Path, state: dict[str, Any], partial: bool = False) -> dict[str, Any]:
    """Load the DCP part of checkpoint `path` into `state` in place (Statefuls get load_state_dict).

    Collective when a process group exists. Resharding is DCP's: the saved world size does not need
    to match this one. partial: the checkpoint may hold keys `state` lacks (export reads the model only).
    Returns meta.json.
    """
    path = Path(path)
    if is_legacy(path):
        raise ValueError(f"{path}: a pre-DCP checkpoint (weights.safetensors + state.pt); load it with "
                         "load_legacy at world size 1, or restart the run")
    reader = _SafeReader(path)
    reader.read_metadata()  # a crafted file fails here, with its own message, before DCP wraps the error
    with _quiet():
        dcp.load(state, storage_reader=reader, planner=_SafePlanner(allow_partial_load=partial),
                 no_dist=not dist.is_initialized())
    return read_meta(path)


def read_rank_state(path: str | Path, rank: int | None = None) -> dict[str, Any] | None:
    """This rank's non-tensor state, or None if the checkpoint was written by fewer ranks."""
    file = Path(path) / f"rank_{_rank() if rank is None else rank:05d}.pt"
    return torch.load(file, weights_only=True) if file.exists() else None


def load_legacy(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights, state, meta) of a pre-DCP checkpoint folder (weights were stored twice there)."""
    from safetensors.torch import load_file

    path = Path(path)
    return (load_file(str(path / "weights.safetensors")), torch.load(path / "state.pt", weights_only=True),
            read_meta(path))
