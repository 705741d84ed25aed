"""The one YAML dialect of fp8rl: run configs (`fp8rl-train cfg.yaml`), sweep files, their
`base_config` and CLI override values are all read here, with the same rules:

- SafeLoader's constructor (never one that builds arbitrary objects), YAML 1.2 numbers (`Loader`):
  `4:00:00` stays the string '4:00:00' (not 14400), `3e-7` is a float;
- a key written twice is an error located at `file:line`, named by its real key path;
- errors are ConfigErrors located as `file:line`.

    data = load_mapping_file("configs/run.yaml")     # a dict (ConfigError if the top is not a mapping)
    doc = YamlDoc.parse(text, name); doc.line(["grid", "seed"])   # where a key lives
    load_value("[0, 1]", key="grid.seed")             # one value (a CLI override's right-hand side)

Where a key lives in a YAML file: key paths -> line numbers, from the composed node tree.

`YamlDoc.parse(text, name)` loads like `yaml.safe_load` (same SafeLoader, same constructor) but keeps
the node tree, so an error about `grid.loss.importance_sampling[1]` can read
`sweeps/x.yaml:12: grid.loss.importance_sampling[1]: ...`. Key paths mix nested and dotted keys
(`grid` maps dotted run-config keys), so lookup at each mapping takes the longest run of parts that
is a key there. Duplicate keys, which `safe_load` silently resolves to the last one, are errors.
The loader is SafeLoader (never a constructor that can build arbitrary objects) with YAML 1.2's
number rules (see SweepLoader).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from fp8rl_core.config.schema import ConfigError

Part = str | int
_INT, _FLOAT, _STR = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:str"
_DOTLESS_FLOAT = re.compile(r"^[-+]?[0-9]+[eE][-+]?[0-9]+$")


class Loader(yaml.SafeLoader):
    """SafeLoader (same safe constructor) with two YAML 1.2 fixes to YAML 1.1's number rules:
    - no base-60 numbers: `time: 4:00:00` stays the string '4:00:00' (safe_load reads the integer
      14400, a silent 10-day SLURM time limit);
    - `3e-7` is a float (safe_load reads a string unless written 3.0e-7)."""

    def resolve(self, kind: type, value: Any, implicit: tuple[bool, bool]) -> str:
        tag = super().resolve(kind, value, implicit)
        if kind is ScalarNode and implicit[0]:
            if tag in (_INT, _FLOAT) and ":" in value:
                return _STR
            if tag == _STR and _DOTLESS_FLOAT.match(value):
                return _FLOAT
        return tag


SweepLoader = Loader  # its former name


def load_value(text: str, key: str = "value") -> Any:
    """One YAML value (a CLI override's right-hand side) read like a file's values."""
    try:
        return yaml.load(text, Loader=Loader)  # a SafeLoader subclass: safe
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as e:
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(key, f"not a valid YAML value {text!r}: {problem}") from None


_TOKEN = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def split_key(key: str) -> list[Part]:
    """'zip[0].optim.lr[2]' -> ['zip', 0, 'optim', 'lr', 2] (indices become ints)."""
    return [int(idx) if idx else name for name, idx in _TOKEN.findall(key)]


def join_key(parts: list[Part] | tuple[Part, ...]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


@dataclass
class YamlDoc:
    name: str  # the file name as the user gave it (used in messages)
    root: Node | None
    data: Any

    @classmethod
    def parse(cls, text: str, name: str) -> YamlDoc:
        """Compose + construct with SafeLoader's constructor (what yaml.safe_load does), node tree kept."""
        loader = Loader(text)
        try:
            root = loader.get_single_node()
            _check_duplicate_keys(root, name)
            data = loader.construct_document(root) if root is not None else None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
            where = f"{name}:{mark.line + 1}" if mark is not None else name
            problem = " ".join(str(getattr(e, "problem", None) or e).split())
            context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
            if context and cmark is not None and cmark is not mark:
                problem = f"{context} (line {cmark.line + 1}): {problem}"
            raise ConfigError("yaml", f"not valid YAML: {problem}", where=where) from None
        except ConfigError:  # a duplicate key, already named and located (ConfigError is a ValueError)
            raise
        except RecursionError:
            raise ConfigError("yaml", "nesting too deep (a recursive alias?)", where=name) from None
        except (ValueError, OverflowError) as e:  # e.g. a date-like scalar that is no date: 2001-13-45
            raise ConfigError("yaml", f"cannot read a value: {e}", where=name) from None
        finally:
            loader.dispose()
        return cls(name, root, data)

    def find(self, parts: list[Part]) -> tuple[Node | None, bool]:
        """Deepest node on `parts` (the key node for a mapping entry; None if none matched) and
        whether all parts matched."""
        node, found, i = self.root, None, 0
        while node is not None and i < len(parts):
            if isinstance(node, MappingNode) and not isinstance(parts[i], int):
                hit = _match_key(node, parts, i)
                if hit is None:
                    break
                found, node, i = hit[0], hit[1], hit[2]
            elif isinstance(node, SequenceNode) and isinstance(parts[i], int) and parts[i] < len(node.value):
                node = found = node.value[parts[i]]
                i += 1
            else:
                break
        return found, i == len(parts)

    def line(self, parts: list[Part], exact: bool = False) -> int | None:
        """1-based line of `parts` (or of its deepest existing ancestor unless `exact`; None when
        not even the first key exists)."""
        node, complete = self.find(parts)
        if not parts and self.root is not None:
            return self.root.start_mark.line + 1
        if node is None or (exact and not complete):
            return None
        return node.start_mark.line + 1


def _match_key(node: MappingNode, parts: list[Part], i: int) -> tuple[Node, Node, int] | None:
    """Longest run parts[i:j] (joined by '.') that is a key of `node` -> (key node, value node, j)."""
    keys = {k.value: (k, v) for k, v in node.value if isinstance(k, ScalarNode)}
    j = i
    while j < len(parts) and not isinstance(parts[j], int):
        j += 1
    for end in range(j, i, -1):
        name = ".".join(str(p) for p in parts[i:end])
        if name in keys:
            return keys[name][0], keys[name][1], end
    return None


def _check_duplicate_keys(root: Node | None, name: str) -> None:
    """Walk the node graph (aliases may make it cyclic) and reject a key written twice."""
    stack: list[tuple[Node, str]] = [(root, "")] if root is not None else []
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, MappingNode):
            first: dict[str, int] = {}
            for k, v in node.value:
                label = k.value if isinstance(k, ScalarNode) else "?"
                key = f"{path}.{label}" if path else label
                if isinstance(k, ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    if k.value in first:
                        where = f"{name}:{k.start_mark.line + 1}"
                        raise ConfigError(key, f"duplicate key (first on line {first[k.value]})", where=where)
                    first[k.value] = k.start_mark.line + 1
                stack.append((v, key))
        elif isinstance(node, SequenceNode):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node.value))


def load_file(path: str | Path) -> YamlDoc:
    """Read and parse a YAML file (ConfigError located at the file when it cannot be read)."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError("", f"cannot read it: {getattr(e, 'strerror', None) or e}", where=str(path)) from None
    return YamlDoc.parse(text, str(path))


def load_mapping_file(path: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file: {})."""
    data = load_file(path).data
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"expected a mapping at the top level, got {type(data).__name__}", where=str(path))
    return data
