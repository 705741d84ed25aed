"""Typed configs from plain dicts: one source of truth for every key, with errors that show the fix.

`build(cls, data, where)` turns a nested dict (from YAML or CLI overrides) into a nested dataclass,
rejecting unknown keys and wrong types with `where: key: what is wrong; valid: ...`. Dataclasses may
define `validate(self) -> None` raising `ConfigError` (via `fail`) for value constraints; numeric keys
check theirs against a table of `Range`s (`check_ranges`), so that every bound lives in one place.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from typing import Any, Literal, get_args, get_origin

import yaml

_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


class ConfigError(ValueError):
    """A bad config value. `str()` reads `where: key: problem; valid: choices`."""

    def __init__(self, key: str, problem: str, valid: str | None = None, where: str = ""):
        self.key, self.problem, self.valid, self.where = key, problem, valid, where
        super().__init__(self._text())

    def _text(self) -> str:
        head = f"{self.where}: " if self.where else ""
        tail = f"; valid: {self.valid}" if self.valid else ""
        return f"{head}{self.key}: {self.problem}{tail}"

    def located(self, where: str, prefix: str = "") -> ConfigError:
        key = f"{prefix}.{self.key}" if prefix and self.key else (prefix or self.key)
        return ConfigError(key, self.problem, self.valid, where or self.where)


def fail(key: str, problem: str, valid: str | None = None) -> None:
    raise ConfigError(key, problem, valid)


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric key allows: finite, low <= x <= high (None: no bound; open_*: strict).

    `why`: what the bound protects, shown after the error when it is not obvious."""
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    why: str = ""

    def allows(self, x: float) -> bool:
        if not math.isfinite(x):
            return False
        if self.low is not None and (x <= self.low if self.open_low else x < self.low):
            return False
        return self.high is None or (x < self.high if self.open_high else x <= self.high)

    def __str__(self) -> str:
        lo, hi = f"{self.low:g}" if self.low is not None else "", f"{self.high:g}" if self.high is not None else ""
        if lo and hi:
            return f"in {'(' if self.open_low else '['}{lo}, {hi}{')' if self.open_high else ']'}"
        if lo:
            return f"{'>' if self.open_low else '>='} {lo}"
        if hi:
            return f"{'<' if self.open_high else '<='} {hi}"
        return "a finite number"


def at_least(low: float) -> Range:
    return Range(low)


def above(low: float) -> Range:
    return Range(low, open_low=True)


def between(low: float, high: float) -> Range:
    return Range(low, high)


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # a KeySpec without a default


@dataclasses.dataclass(frozen=True)
class KeySpec:
    """One run-config key's row in the table of keys (run_config.KEYS): its allowed range and what the cell
    id and the engine checks need to know of it. The tables the code reads (RANGES, HASH_IF_NOT_DEFAULT,
    HASH_FP8_TRAINING_ONLY, FP8_ONLY_KEYS, NATIVE_ONLY_KEYS) are derived from the rows.

    key: dotted (`fp8.format`), or a whole section (`engines.vllm`).
    range: a numeric key's allowed values (check_ranges); None: not numeric.
    default: the value at which the key counts as unset, frozen when the key came (not read from the
        dataclass, so that a changed default cannot move old ids); a spec class stands for its default
        instance. Needed by `hashed` other than "always" and by `native_only`.
    hashed: "always" (the key existed with the first cell ids); "when_set": it came later and enters the id
        only where it differs from `default`, so the ids written before it stay; "when_set_or_fp8_training":
        as "when_set", but always for a recipe that trains in FP8 (whose numerics it changed when it came).
    fp8_only: left out of the id of a recipe that quantizes nothing (an `fp8.*` key the bf16 recipe ignores).
    native_only: a value other than `default` runs in the native engines only; with vLLM or Megatron-Core on
        a side that quantizes it is a config error.
    """

    key: str
    range: Range | None = None
    default: Any = UNSET
    hashed: Literal["always", "when_set", "when_set_or_fp8_training"] = "always"
    fp8_only: bool = False
    native_only: bool = False

    def __post_init__(self) -> None:
        if self.hashed not in ("always", "when_set", "when_set_or_fp8_training"):
            raise ValueError(f"KeySpec {self.key!r}: hashed={self.hashed!r}; valid: always, when_set, "
                             "when_set_or_fp8_training")
        if self.default is UNSET and (self.hashed != "always" or self.native_only):
            raise ValueError(f"KeySpec {self.key!r}: hashed={self.hashed!r} / native_only need the key's "
                             "default (the value at which it counts as unset)")
        if self.fp8_only and not self.key.startswith("fp8."):
            raise ValueError(f"KeySpec {self.key!r}: fp8_only is for fp8.* keys")


def _keys_where(keys: typing.Iterable[KeySpec], **match: Any) -> list[KeySpec]:
    return [k for k in keys if all(getattr(k, name) == value for name, value in match.items())]


def ranges_of(keys: typing.Iterable[KeySpec]) -> dict[str, Range]:
    """key -> Range of the numeric rows (what check_ranges reads)."""
    return {k.key: k.range for k in keys if k.range is not None}


def defaults_where(keys: typing.Iterable[KeySpec], **match: Any) -> dict[str, Any]:
    """key -> default of the rows whose fields equal `match` (e.g. hashed="when_set")."""
    return {k.key: k.default for k in _keys_where(keys, **match)}


def numeric_fields(cls: type) -> list[tuple[str, bool]]:
    """(name, is_list) of a dataclass's numeric fields: int and float, optional or not, and lists of them.

    bool is not numeric here (a flag has no range)."""
    out = []
    for name, tp in typing.get_type_hints(cls).items():
        args = [a for a in get_args(tp) if a is not type(None)] if get_origin(tp) in (typing.Union, types.UnionType) \
            else [tp]
        is_list = len(args) == 1 and get_origin(args[0]) is list
        if is_list:
            args = list(get_args(args[0]))
        if args and all(a in (int, float) for a in args):
            out.append((name, is_list))
    return out


def check_ranges(obj: Any, ranges: typing.Mapping[str, Range], section: str = "") -> None:
    """ConfigError for the first numeric field of dataclass `obj` outside its range, `ranges[section.name]`
    (a list: each item). The key is named relative to `obj`, as `build` locates it; None (an optional key
    left unset) and a key without a range pass."""
    for name, is_list in numeric_fields(type(obj)):
        rng, value = ranges.get(f"{section}.{name}" if section else name), getattr(obj, name)
        if rng is None or value is None:
            continue
        for i, v in enumerate(value) if is_list else [(None, value)]:
            if not rng.allows(v):
                why = f" ({rng.why})" if rng.why else ""
                fail(name if i is None else f"{name}[{i}]", f"must be {rng}, got {v!r}{why}")


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check/convert `value` to type `tp` (int -> float allowed; nothing else is guessed)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        if value not in args:
            fail(key, f"{value!r} is not allowed", ", ".join(str(a) for a in args))
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            fail(key, f"expected a mapping, got {type(value).__name__}", ", ".join(field_names(tp)))
        return build(tp, value, prefix=key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            fail(key, f"expected a list, got {type(value).__name__} {value!r}")
        item = args[0] if args else Any
        return type(value)(_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)) if origin is list \
            else tuple(_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            fail(key, f"expected a mapping, got {type(value).__name__}")
        return {str(k): _coerce(args[1] if args else Any, v, f"{key}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _FLOAT_RE.match(value.strip()):
        return float(value)  # PyYAML (YAML 1.1) reads `3e-4` as a string; it is plainly a number
    if tp is bool and not isinstance(value, bool):
        fail(key, f"expected true or false, got {value!r}")
    if tp is int and isinstance(value, bool):
        fail(key, f"expected an integer, got {value!r}")
    if isinstance(tp, type) and not isinstance(value, tp):
        fail(key, f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def build(cls: type, data: dict | None, where: str = "", prefix: str = "") -> Any:
    """Build dataclass `cls` from `data`; unknown keys and bad values raise ConfigError."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    names = field_names(cls)
    kwargs = {}
    try:
        for k, v in data.items():
            if k not in names:
                fail(str(k), "unknown key", ", ".join(names))
            kwargs[k] = _coerce(hints[k], v, str(k))
        obj = cls(**kwargs)
        if hasattr(obj, "validate"):
            obj.validate()
        return obj
    except ConfigError as e:
        raise e.located(where, prefix) from None


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain nested dict/list (YAML/JSON friendly)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` -> ("a.b", yaml-typed value). Raises ConfigError on a missing '='."""
    if "=" not in text:
        fail(text, "an override must read key=value (e.g. loss.importance_sampling=token)")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw) if raw.strip() else ""


def set_dotted(data: dict, key: str, value: Any) -> None:
    """Set `data[a][b] = value` for key 'a.b', creating intermediate dicts."""
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.get(p)
        if not isinstance(nxt, dict):
            nxt = {}
            node[p] = nxt
        node = nxt
    node[parts[-1]] = value


def get_dotted(data: dict, key: str, default: Any = None) -> Any:
    node: Any = data
    for p in key.split("."):
        if not isinstance(node, dict) or p not in node:
            return default
        node = node[p]
    return node


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1} (lists stay values)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def stable_hash(data: Any, length: int = 12) -> str:
    """sha256 of canonical JSON (sorted keys): the same config gives the same id on every machine."""
    text = json.dumps(to_dict(data), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]
