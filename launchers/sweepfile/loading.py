"""Load a sweep file: YAML -> CLI overrides -> typed spec -> resolved base run config -> checked axes.

`load_sweep(path, overrides)` runs every check that needs no expansion and has no side effect (it
reads the sweep file and its base_config, nothing else). Every error is a SweepError located at
`file:line` (or `command line (key=value)`). `launchers.plan.grid.expand(sweep)` then makes the cells.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp8rl_core.config import RunConfig, run_config_from_dict
from fp8rl_core.config.schema import ConfigError, build, flatten, get_dotted
from fp8rl_core.config.yaml_io import YamlDoc, split_key
from fp8rl_core.tracking.store import absolute_uri
from launchers.sweepfile import keys as run_keys
from launchers.sweepfile.overrides import apply_sweep_overrides
from launchers.sweepfile.schema import LauncherSpec, SweepError, SweepSpec
from launchers.sweepfile.search_space import JOURNAL_NAME, check_search

_BOOL_HINT = " (YAML reads yes/no/on/off as booleans: quote the value, e.g. 'off')"


@dataclass(frozen=True)
class Axis:
    """One varied run-config key: its typed values, in file order."""
    key: str  # dotted run-config key, e.g. loss.importance_sampling
    path: tuple[str, ...]
    values: tuple[Any, ...]  # typed as RunConfig types them (1 -> 1.0 for a float field)
    label: str  # where it is written: grid.seed or zip[0].optim.lr
    group: int | None  # zip group index (None: a grid key, a factor of its own)


@dataclass(frozen=True)
class Exclusion:
    label: str  # exclude[i]
    allowed: dict[str, tuple[Any, ...]]  # key -> the values that match (a cell matching every key is dropped)


@dataclass
class Locator:
    """Sweep-file keys -> `file:line`, looking in CLI overrides, the sweep file, then base_config."""
    doc: YamlDoc
    base_doc: YamlDoc | None = None
    overrides: dict[str, str] = field(default_factory=dict)  # key set -> override text

    def where(self, key: str) -> str:
        parts = split_key(key)
        for okey, text in self.overrides.items():
            oparts = split_key(okey)
            if parts[:len(oparts)] == oparts or (parts and oparts[:len(parts)] == parts):
                return f"command line ({text})"
        line = self.doc.line(parts, exact=True)
        if line is None and self.base_doc is not None and parts[:1] == ["base"]:
            base_line = self.base_doc.line(parts[1:], exact=True)
            if base_line is not None:
                return f"{self.base_doc.name}:{base_line}"
        line = line or self.doc.line(parts)
        return f"{self.doc.name}:{line}" if line else self.doc.name

    def relocate(self, e: ConfigError, prefix: str = "") -> SweepError:
        key = f"{prefix}.{e.key}" if prefix and e.key else (prefix or e.key)
        problem = e.problem + (_BOOL_HINT if re.match(r"(True|False) is not allowed", e.problem) else "")
        return SweepError(key, problem, e.valid, self.where(key))


@dataclass
class Sweep:
    """A validated sweep file: the spec, the resolved base run config and the typed axes."""
    spec: SweepSpec
    name: str  # the sweep file as given (messages)
    cwd: Path  # relative folder / sqlite / journal paths resolve against it
    base_data: dict[str, Any]  # base run-config mapping: base_config, then base, then overrides
    base_config: RunConfig
    axes: list[Axis]
    exclusions: list[Exclusion]
    locator: Locator
    overrides: tuple[str, ...] = ()

    @property
    def experiment(self) -> str:
        return self.spec.experiment

    @property
    def launcher(self) -> LauncherSpec:
        return self.spec.launcher

    @property
    def folder_label(self) -> str:
        """launcher.folder as written (default outputs/<experiment>)."""
        return self.spec.launcher.folder or f"outputs/{self.experiment}"

    @property
    def folder(self) -> Path:
        """Absolute sweep folder: submitit logs (jobs/), per-cell outputs (cells/<id>), journal."""
        return self.cwd / Path(self.folder_label).expanduser()

    def tracking_uri(self) -> str:
        """tracking.uri with a relative sqlite path made absolute (jobs may run in another folder)."""
        return absolute_uri(self.spec.tracking.uri, self.cwd)

    def study_storage(self) -> str:
        """An Optuna search's storage: an RDB URL as given, or the absolute path of a journal file
        (default <sweep folder>/optuna.journal; journal files are safe with many workers on NFS)."""
        storage = self.spec.search.storage if self.spec.search else None
        if storage and "://" in storage:
            return storage
        path = Path(storage).expanduser() if storage else self.folder / JOURNAL_NAME
        return str(path if path.is_absolute() else self.cwd / path)

    def error(self, key: str, problem: str, valid: str | None = None) -> SweepError:
        return SweepError(key, problem, valid, self.locator.where(key))


def load_sweep(path: str | Path, overrides: list[str] | tuple[str, ...] = (), cwd: Path | None = None) -> Sweep:
    """Read, override and validate a sweep file (SweepError on any problem; nothing is written)."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SweepError("", f"cannot read the sweep file: {getattr(e, 'strerror', None) or e}",
                         where=str(path)) from None
    return load_sweep_text(text, str(path), overrides, base_dir=path.parent, cwd=cwd)


def load_sweep_text(text: str, name: str = "<sweep>", overrides: list[str] | tuple[str, ...] = (),
                    base_dir: Path = Path("."), cwd: Path | None = None) -> Sweep:
    """load_sweep on YAML text; `base_dir` resolves base_config, `cwd` the output paths."""
    try:
        doc = YamlDoc.parse(text, name)
    except ConfigError as e:
        raise SweepError(e.key, e.problem, e.valid, e.where) from None
    locator = Locator(doc)
    data = {} if doc.data is None else doc.data
    if not isinstance(data, dict):
        raise locator.relocate(ConfigError("", f"expected a mapping at the top level, got {type(data).__name__}",
                                           "experiment, base, grid, launcher, ..."))
    try:
        data, locator.overrides = apply_sweep_overrides(data, overrides)
    except ConfigError as e:
        raise SweepError(e.key, e.problem, e.valid, e.where) from None
    _flatten_axes(data)
    try:
        spec = build(SweepSpec, data)
    except ConfigError as e:
        raise locator.relocate(e) from None
    base_data = _resolve_base(spec, base_dir, locator)
    try:
        base_config = run_config_from_dict(base_data)
    except ConfigError as e:
        raise locator.relocate(e, "base") from None
    try:
        _check_engine_owned(base_data)
        axes, exclusions = _check_axes(spec, base_data)
        if spec.search is not None:
            check_search(spec.search, base_data)
    except ConfigError as e:
        raise locator.relocate(e) from None
    return Sweep(spec, name, (cwd or Path.cwd()).absolute(), base_data, base_config, axes, exclusions,
                 locator, tuple(overrides))


def _flatten_axes(data: dict[str, Any]) -> None:
    """Nested keys in grid/zip/exclude mean dotted ones: {loss: {importance_sampling: [...]}} is
    {loss.importance_sampling: [...]} (no RunConfig leaf a sweep may vary is a mapping)."""
    if isinstance(data.get("grid"), dict):
        data["grid"] = flatten(data["grid"])
    for section in ("zip", "exclude"):
        if isinstance(data.get(section), list):
            data[section] = [flatten(g) if isinstance(g, dict) else g for g in data[section]]


def _resolve_base(spec: SweepSpec, base_dir: Path, locator: Locator) -> dict[str, Any]:
    """base_config (a run config file, relative to the sweep file) deep-merged under `base`."""
    if not spec.base_config:
        return dict(spec.base)
    path = Path(spec.base_config).expanduser()
    path = path if path.is_absolute() else base_dir / path
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, 'strerror', None) or e
        raise locator.relocate(ConfigError("base_config", f"cannot read {path}: {why}")) from None
    try:
        locator.base_doc = YamlDoc.parse(text, str(path))
    except ConfigError as e:
        raise SweepError(e.key, e.problem, e.valid, e.where) from None
    data = locator.base_doc.data or {}
    if not isinstance(data, dict):
        raise SweepError("", f"a run config must be a mapping, got {type(data).__name__}", where=str(path))
    return _merge(data, spec.base)


def _merge(low: dict[str, Any], high: dict[str, Any]) -> dict[str, Any]:
    out = dict(low)
    for k, v in high.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _check_engine_owned(base_data: dict[str, Any]) -> None:
    missing = object()
    for key, why in run_keys.ENGINE_OWNED.items():
        if get_dotted(base_data, key, missing) is not missing:
            raise ConfigError(f"base.{key}", why)


def _check_axes(spec: SweepSpec, base_data: dict[str, Any]) -> tuple[list[Axis], list[Exclusion]]:
    """Type every grid and zip value through the run config; type the exclusions."""
    axes = []
    written = [(key, values, f"grid.{key}", None) for key, values in spec.grid.items()]
    written += [(k, v, f"zip[{g}].{k}", g) for g, group in enumerate(spec.zip) for k, v in group.items()]
    if spec.seeds is not None:  # replicates: one more factor, varied fastest (cells of one seed stay adjacent)
        written.append(("seed", spec.seed_values(), "seeds", None))
    for key, values, label, group in written:
        try:
            path = run_keys.varied_key(key)
        except ConfigError as e:
            raise ConfigError(label, e.problem, e.valid) from None
        typed = run_keys.check_values(base_data, key, values, label, unique=group is None)
        axes.append(Axis(key, path, tuple(typed), label, group))
    exclusions = []
    for i, rule in enumerate(spec.exclude):
        allowed = {}
        for key, value in rule.items():
            any_of = isinstance(value, list) and (not run_keys.is_list_field(key) or
                                                  all(isinstance(v, list) for v in value) and value)
            items = value if any_of else [value]
            if not items:
                raise ConfigError(f"exclude[{i}].{key}", "empty list matches nothing")
            label = f"exclude[{i}].{key}"
            typed = [run_keys.typed_value(base_data, key, v, label if not any_of else f"{label}[{j}]")
                     for j, v in enumerate(items)]
            allowed[key] = tuple(typed)
        exclusions.append(Exclusion(f"exclude[{i}]", allowed))
    return axes, exclusions

