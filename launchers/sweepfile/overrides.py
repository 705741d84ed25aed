"""CLI overrides on a sweep file: `sweep plan FILE launcher=slurm max_parallel=8 base.train.steps=5`.

Each override is `key=value`, the value read as YAML (`grid.seed=[0,1,2]`, `launcher.slurm.time="4:00:00"`).
Keys are sweep-file paths, with these rules:
- shorthands: `launcher=KIND`, `max_parallel=N`, `retries=N`, `folder=PATH` (all under `launcher.`);
- `grid.<run-config key>=[...]` sets one grid entry (the rest of the key is the dotted run-config key);
- `search.params.<run-config key>.<field>=v` sets one field of a search param (or the whole param);
- `zip` and `exclude` are lists: replace them whole (`exclude=[]`);
- anything else is a nested path (`base.loss.importance_sampling=token`, `launcher.slurm.partition=gpu`).
"""
from __future__ import annotations

import copy
from typing import Any

from fp8rl_core.config.schema import ConfigError, fail
from fp8rl_core.config.yaml_io import join_key, load_value
from launchers.sweepfile.schema import SearchParamSpec

ALIASES = {"launcher": "launcher.kind", "max_parallel": "launcher.max_parallel",
           "retries": "launcher.retries", "folder": "launcher.folder"}
_PARAM_FIELDS = {f for f in SearchParamSpec.__dataclass_fields__}


def override_path(key: str, value: Any, data: dict[str, Any]) -> list[str]:
    """The sweep-file path an override key sets, e.g. 'grid.loss.is_cap' -> ['grid', 'loss.is_cap']."""
    if key in ALIASES and not (key == "launcher" and isinstance(value, dict)):
        key = ALIASES[key]
    parts = key.split(".")
    if not key or any(not p for p in parts):
        fail(key, "an override key must be a dotted path (e.g. launcher.max_parallel=8)")
    head = parts[0]
    if head == "grid" and len(parts) > 1:
        return ["grid", ".".join(parts[1:])]
    if head in ("zip", "exclude") and len(parts) > 1:
        fail(key, f"{head} is a list: override it whole", f"{head}=[...]")
    if parts[:2] == ["search", "params"] and len(parts) > 2:
        rest = parts[2:]
        params = (data.get("search") or {}).get("params") if isinstance(data.get("search"), dict) else None
        whole = ".".join(rest)
        if len(rest) > 1 and rest[-1] in _PARAM_FIELDS and not (isinstance(params, dict) and whole in params):
            return ["search", "params", ".".join(rest[:-1]), rest[-1]]
        return ["search", "params", whole]
    return parts


def _set(data: dict[str, Any], path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            fail(join_key(path), f"cannot set it: {join_key(path[:i + 1])} is {type(nxt).__name__}, not a mapping")
        node = nxt
    node[path[-1]] = value


def apply_sweep_overrides(data: dict[str, Any], overrides: list[str] | tuple[str, ...]
                          ) -> tuple[dict[str, Any], dict[str, str]]:
    """Return (a copy of `data` with the overrides applied, {key set: the override's text}).

    Errors are ConfigErrors located at `command line (TEXT)`."""
    out = copy.deepcopy(data)
    origin: dict[str, str] = {}
    for text in overrides:
        where = f"command line ({text})"
        try:
            if "=" not in text:
                fail(text, "an override must read key=value", "e.g. max_parallel=8, base.train.steps=5")
            key, raw = (s.strip() for s in text.split("=", 1))
            value = load_value(raw, key) if raw else ""
            path = override_path(key, value, out)
            _set(out, path, value)
        except ConfigError as e:
            raise e.located(where) from None
        origin[join_key(path)] = text
    return out, origin
