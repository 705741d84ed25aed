"""A cell: one run of the core, identified by the hash of its fully resolved run config.

The id (`fp8rl_core.config.run_config_hash`) does not depend on the cell's position in the grid, on
the order of the sweep file's keys, or on where the run writes (output_dir, tracking): the same
config in another sweep, or after the grid grew, is the same cell. It is the MLflow tag `cell_id`.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp8rl_core.config import RunConfig, TrackingSpec, run_config_hash
from fp8rl_core.config.schema import ConfigError
from fp8rl_core.tracking import TAG_CELL_ID, TAG_IS, TAG_RECIPE, TAG_SEED, TAG_SWEEP

if TYPE_CHECKING:  # pragma: no cover
    from launchers.sweepfile.loading import Sweep

CELLS_SUBFOLDER = "cells"  # <sweep folder>/cells/<cell id>: a cell's output_dir (checkpoints, logs)


@dataclass(frozen=True)
class Cell:
    id: str  # run_config_hash(config), 12 hex digits
    index: int  # position in the expansion (display order only, not identity)
    params: dict[str, Any]  # the varied keys -> this cell's typed values, in column order
    config: RunConfig  # resolved; shares untouched sub-objects with other cells: treat as read-only

    def label(self) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in self.params.items()) + "}"


def check_unique(cells: list[Cell]) -> None:
    """Two cells with one resolved config would run the same thing twice: ConfigError naming both."""
    seen: dict[str, Cell] = {}
    for cell in cells:
        other = seen.setdefault(cell.id, cell)
        if other is not cell:
            raise ConfigError("grid", f"duplicate cells: {other.label()} and {cell.label()} resolve to the "
                              f"same run config (id {cell.id})", "vary keys that change the run")


def cell_tags(sweep: Sweep, cell: Cell) -> dict[str, str]:
    """The MLflow contract's child-run tags (docs/design.md): sweep, cell_id, recipe, importance_sampling, seed."""
    cfg = cell.config
    return {TAG_SWEEP: sweep.experiment, TAG_CELL_ID: cell.id, TAG_RECIPE: cfg.recipe,
            TAG_IS: cfg.loss.importance_sampling, TAG_SEED: str(cfg.seed)}


def cell_run_config(sweep: Sweep, cell: Cell, run_id: str | None = None,
                    parent_run_id: str | None = None) -> RunConfig:
    """The config a job runs: the cell's, plus where to write (sweep folder, tracking, tags), with its
    paths absolute: jobs may start in another directory, and the driver logs this one resolved config
    as the cell run's params before any job runs it (a path resolved later would change a logged
    param, which MLflow refuses).

    Only fields outside the id change (fp8rl_core.config.HASH_EXCLUDE), which is asserted."""
    cfg = copy.deepcopy(cell.config)
    tags = {**cfg.tracking.tags, **cell_tags(sweep, cell)}
    cache = Path(cfg.warmstart.cache_dir).expanduser()
    cfg = dataclasses.replace(
        cfg, output_dir=str(sweep.folder / CELLS_SUBFOLDER / cell.id),
        warmstart=cfg.warmstart if cache.is_absolute() else dataclasses.replace(cfg.warmstart,
                                                                                cache_dir=str(sweep.cwd / cache)),
        tracking=TrackingSpec(uri=sweep.tracking_uri(), experiment=sweep.experiment, run_id=run_id,
                              parent_run_id=parent_run_id, tags=tags))
    if run_config_hash(cfg) != cell.id:  # a HASH_EXCLUDE change would silently re-key every cell
        raise RuntimeError(f"cell {cell.id}: where-to-write fields changed its id; check HASH_EXCLUDE")
    return cfg
