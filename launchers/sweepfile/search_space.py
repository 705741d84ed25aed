"""An Optuna search's space: `search.params` checked against the run config, and as Optuna objects.

Each param is a dotted run-config key with a range (float/int, optional log scale or step) or a list
of choices. Every trial becomes a cell (`launchers.plan.grid.cell_for`), so its id is the hash of its
resolved config like any grid cell. Optuna is imported only by the functions that build its objects.
"""
from __future__ import annotations

import math
from typing import Any

from fp8rl_core.config.schema import ConfigError, fail
from launchers.sweepfile import keys as run_keys
from launchers.sweepfile.schema import SearchSpec

JOURNAL_NAME = "optuna.journal"


def check_search(search: SearchSpec, base_data: dict[str, Any]) -> None:
    """Every param names a varied run-config key whose type takes the param's values (ConfigError)."""
    for key, p in search.params.items():
        label = f"search.params.{key}"
        try:
            run_keys.varied_key(key)
        except ConfigError as e:
            raise ConfigError(label, e.problem, e.valid) from None
        if p.type == "categorical":
            run_keys.check_values(base_data, key, list(p.choices or []), f"{label}.choices")
            continue
        if p.type == "float" and not run_keys.accepts_float(key):
            fail(f"{label}.type", f"{key} takes no float", "int, categorical")
        for name in ("low", "high"):
            run_keys.typed_value(base_data, key, getattr(p, name), f"{label}.{name}")


def grid_size(search: SearchSpec) -> int:
    return math.prod(len(p.choices or []) for p in search.params.values())


def n_trials(search: SearchSpec) -> int:
    """Trials to run: n_trials, or for the grid sampler (default) the size of the grid."""
    return search.n_trials if search.n_trials is not None else grid_size(search)


def describe(p: Any) -> str:
    """One line per param for `sweep plan`: 'float [1e-05, 0.001] log' or 'categorical [a, b]'."""
    if p.type == "categorical":
        return "categorical [" + ", ".join(str(c) for c in p.choices) + "]"
    extra = " log" if p.log else (f" step {p.step}" if p.step is not None else "")
    return f"{p.type} [{p.low}, {p.high}]{extra}"
