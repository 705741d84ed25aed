"""Dotted run-config keys (`loss.importance_sampling`): resolve them to RunConfig fields, check values.

The fields, their types and their checks come from fp8rl_core.config's dataclasses (one source of
truth): a value is checked by building a RunConfig with it, never by a rule copied here.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from typing import Any, get_args, get_origin

from fp8rl_core.config import HASH_EXCLUDE, RunConfig, run_config_from_dict
from fp8rl_core.config.schema import ConfigError, fail, field_names, set_dotted

# Set per cell by the sweep engine, so a sweep file may not set them in base (nor vary them).
ENGINE_OWNED = {
    "output_dir": "set per cell by the sweep engine (<launcher.folder>/cells/<cell id>)",
    "tracking.uri": "set by the sweep file's tracking.uri",
    "tracking.experiment": "set by the sweep file's experiment",
    "tracking.run_id": "set per cell by the sweep engine",
    "tracking.parent_run_id": "set per cell by the sweep engine",
}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def leaf_type(key: str) -> Any:
    """Type annotation of the RunConfig leaf field `key` (ConfigError if not a leaf field)."""
    cls: Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        names = field_names(cls)
        if part not in names:
            where = f" (no field {part!r} in {'.'.join(parts[:i])})" if i else ""
            fail(key, f"unknown run-config key{where}", ", ".join(names))
        tp = _hints(cls)[part]
        last = i == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                fail(key, "is a section; vary one of its fields", ", ".join(f"{key}.{n}" for n in field_names(tp)))
            cls = tp
        elif not last:
            fail(key, f"{'.'.join(parts[:i + 1])} is a value, not a section")
    return tp


def varied_key(key: str) -> tuple[str, ...]:
    """Check that a sweep may vary `key` (a leaf of RunConfig that is part of the cell id) -> its path."""
    leaf_type(key)
    excluded = [x for x in HASH_EXCLUDE if key == x or key.startswith(x + ".")]
    if excluded or key in ENGINE_OWNED:
        fail(key, "does not change what a run computes (not part of a cell's id); set it in base, or "
             "leave it to the sweep engine")
    return tuple(key.split("."))


def is_list_field(key: str) -> bool:
    return get_origin(leaf_type(key)) in (list, tuple)


def accepts_float(key: str) -> bool:
    tp = leaf_type(key)
    return tp is float or float in get_args(tp) or tp is Any


def get_path(obj: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        obj = getattr(obj, part)
    return obj


def coerce_value(base_data: dict[str, Any], key: str, value: Any) -> Any:
    """`value` for `key` as the run config types it (1 -> 1.0 for a float), checked by building a
    RunConfig from the base with it; ConfigError names the problem (its key is a run-config key)."""
    data = copy.deepcopy(base_data)
    set_dotted(data, key, value)
    cfg = run_config_from_dict(data)
    return get_path(cfg, tuple(key.split(".")))


def typed_value(base_data: dict[str, Any], key: str, value: Any, label: str) -> Any:
    """coerce_value, with the error named by the sweep-file key `label` (e.g. grid.seed[1])."""
    try:
        return coerce_value(base_data, key, value)
    except ConfigError as e:
        problem = e.problem if e.key == key else f"with this value, {e.key}: {e.problem}"
        raise ConfigError(label, problem, e.valid) from None


def check_values(base_data: dict[str, Any], key: str, values: list[Any], label: str,
                 unique: bool = True) -> list[Any]:
    """Type each of `values` (the list at sweep key `label`, e.g. 'grid.seed'); errors name the item.

    With `unique`, a value that equals an earlier one (after typing: 1 and 1.0 for a float) is an
    error: it would make two identical cells (a zip column may repeat values; its rows may not)."""
    out: list[Any] = []
    for i, value in enumerate(values):
        typed = typed_value(base_data, key, value, f"{label}[{i}]")
        if unique and typed in out:
            fail(f"{label}[{i}]", f"{value!r} repeats item [{out.index(typed)}] (two identical cells)")
        out.append(typed)
    return out
