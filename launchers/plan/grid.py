"""Grid expansion: a sweep's cells in a stable order, each a resolved, validated RunConfig with its id.

Factors: each grid key is one factor (its values); each zip group is one factor (its rows, keys
varied together). The cells are the product of the factors, in file order with the last key varying
fastest, minus the cells an exclusion matches (a cell matches when each of the exclusion's keys has
one of its values).

A cell's config is the validated base with the cell's typed values put in by `dataclasses.replace`,
and `validate()` run again on every section that changed: the checks `schema.build` runs, without
rebuilding the untouched parts. Its id is `run_config_hash` computed the same way from the base's
canonical dict with the cell's values put in (`_IdHasher`), checked against run_config_hash itself on
the first and last cell of every expansion. Measured here (benchmarks/sweep_plan.py, 2 busy cores):
building and hashing 10,000 configs from dicts takes ≈8-10 s, this ≈0.4 s.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from typing import Any

from fp8rl_core.config import RunConfig, run_config_hash, strip_unhashed
from fp8rl_core.config.schema import ConfigError, to_dict
from launchers.plan.cells import Cell, check_unique
from launchers.sweepfile import keys as run_keys
from launchers.sweepfile.loading import Axis, Sweep

MAX_CELLS = 100_000  # a plan beyond this is a mistake (each cell is a training run); split the sweep

Option = tuple[tuple[Axis, Any], ...]  # one choice of a factor: (axis, typed value) pairs


@dataclass
class Expansion:
    cells: list[Cell]
    combinations: int  # size of the product, before exclusions
    excluded: int


def factors(sweep: Sweep) -> list[list[Option]]:
    """Grid keys then zip groups, in file order; each a list of options."""
    out: list[list[Option]] = [[((a, v),) for v in a.values] for a in sweep.axes if a.group is None]
    for g in sorted({a.group for a in sweep.axes if a.group is not None}):
        group = [a for a in sweep.axes if a.group == g]
        out.append([tuple((a, a.values[r]) for a in group) for r in range(len(group[0].values))])
    return out


def expand(sweep: Sweep) -> list[Cell]:
    """The sweep's cells (SweepError on a bad combination or on duplicate cells)."""
    return expand_grid(sweep).cells


def expand_grid(sweep: Sweep) -> Expansion:
    facs = factors(sweep)
    total = math.prod(len(f) for f in facs)
    if total > MAX_CELLS:
        raise sweep.error("grid", f"{total} combinations is more than {MAX_CELLS}; split the sweep")
    rules = _exclusion_rules(sweep, facs)
    paths = [a.path for f in facs for a, _ in f[0]]
    tree, hasher = _path_tree(paths), _IdHasher(sweep.base_config)
    cells: list[Cell] = []
    for idx in itertools.product(*(range(len(f)) for f in facs)):
        if any(all(idx[f] in ok for f, ok in rule) for rule in rules):
            continue
        pairs = [pair for f, i in zip(facs, idx) for pair in f[i]]
        cells.append(_make_cell(sweep, pairs, tree, len(cells), hasher))
    if not cells:
        raise sweep.error("exclude", f"every one of the {total} combinations is excluded")
    for cell in {cells[0].id: cells[0], cells[-1].id: cells[-1]}.values():
        if run_config_hash(cell.config) != cell.id:
            raise RuntimeError(f"cell {cell.label()}: the fast id {cell.id} differs from run_config_hash "
                               f"{run_config_hash(cell.config)}; launchers/plan/grid.py _IdHasher is out of date")
    try:
        check_unique(cells)
    except ConfigError as e:
        raise sweep.locator.relocate(e) from None
    return Expansion(cells, total, total - len(cells))


def cell_for(sweep: Sweep, values: dict[str, Any], index: int = 0) -> Cell:
    """The cell for arbitrary values of varied keys (an Optuna trial's params): typed, validated, hashed."""
    pairs = []
    for key, value in values.items():
        try:
            path = run_keys.varied_key(key)
            typed = run_keys.typed_value(sweep.base_data, key, value, key)
        except ConfigError as e:
            raise sweep.error(f"search.params.{e.key}", e.problem, e.valid) from None
        pairs.append((Axis(key, path, (typed,), f"search.params.{key}", None), typed))
    return _make_cell(sweep, pairs, _path_tree([a.path for a, _ in pairs]), index, None)


class _IdHasher:
    """run_config_hash of `base` with a few leaves changed, without converting the whole config again.

    Same payload as fp8rl_core.config.run_config_hash (`strip_unhashed` after the cell's values are put
    in: a varied key at its default, or one that a recipe ignores, leaves the id as the base would) and the
    same formula as fp8rl_core.config.schema.stable_hash; expand_grid checks it against run_config_hash."""

    def __init__(self, base: RunConfig, length: int = 12):
        self.canon, self.length = to_dict(base), length

    def __call__(self, paths: list[tuple[str, ...]], values: list[Any]) -> str:
        data = dict(self.canon)
        for path, value in zip(paths, values):
            node = data
            for part in path[:-1]:
                node[part] = node = dict(node[part])  # copy on write: the base dict stays intact
            node[path[-1]] = to_dict(value)
        text = json.dumps(strip_unhashed(data), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:self.length]


def _exclusion_rules(sweep: Sweep, facs: list[list[Option]]) -> list[list[tuple[int, set[int]]]]:
    """Per exclusion: [(factor index, option indices that match)] over the factors it touches."""
    rules = []
    for ex in sweep.exclusions:
        rule = []
        for f, options in enumerate(facs):
            keys = {a.key for a, _ in options[0]} & ex.allowed.keys()
            if keys:
                ok = {i for i, opt in enumerate(options)
                      if all(v in ex.allowed[a.key] for a, v in opt if a.key in keys)}
                rule.append((f, ok))
        rules.append(rule)
    return rules


def _path_tree(paths: list[tuple[str, ...]]) -> dict[str, Any]:
    """[('loss', 'is_cap'), ('seed',)] -> {'loss': {'is_cap': 0}, 'seed': 1} (leaf: value position)."""
    tree: dict[str, Any] = {}
    for pos, path in enumerate(paths):
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = pos
    return tree


def _replace(obj: Any, tree: dict[str, Any], values: list[Any], prefix: str) -> Any:
    kwargs = {name: values[t] if isinstance(t, int) else _replace(getattr(obj, name), t, values, f"{prefix}{name}.")
              for name, t in tree.items()}
    new = dataclasses.replace(obj, **kwargs)
    if hasattr(new, "validate"):
        try:
            new.validate()
        except ConfigError as e:
            raise e.located("", prefix.rstrip(".")) from None
    return new


def _make_cell(sweep: Sweep, pairs: list[tuple[Axis, Any]], tree: dict[str, Any], index: int,
               hasher: _IdHasher | None) -> Cell:
    values = [v for _, v in pairs]
    params = {a.key: v for a, v in pairs}
    try:
        config = _replace(sweep.base_config, tree, values, "")
    except ConfigError as e:
        # A combination that no single value breaks (e.g. min_digits > digits): name the cell.
        section = e.key.rpartition(".")[0]
        axis = next((a for a, _ in pairs if a.key == e.key), None) or \
            next((a for a, _ in pairs if a.key.rpartition(".")[0] == section), pairs[0][0])
        cell = Cell("", index, params, sweep.base_config).label()
        raise sweep.error(axis.label, f"{e.key}: {e.problem} (in the cell {cell})", e.valid) from None
    cell_id = hasher([a.path for a, _ in pairs], values) if hasher else run_config_hash(config)
    return Cell(cell_id, index, params, config)
