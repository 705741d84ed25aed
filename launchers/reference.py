"""The sweep-file reference (Markdown), generated from the schema's dataclasses so that it cannot drift.

    python -m launchers.reference                     # print it
    python -m launchers.reference --write docs/sweep-reference.md   # replace the text between the markers
    python -m launchers.reference --check docs/sweep-reference.md   # exit 1 with a diff when it is stale

Every row comes from code: the key, type and default from `dataclasses.fields` and the type hints of
launchers/sweepfile/schema.py (the sweep file) and fp8rl_core/config/run_config.py (the run config under `base:`); the
meaning from the field's trailing `# comment` (or, without one, the comment lines right above the
field), read from the class source with `tokenize`; a section's intro from its class docstring, else
from its parent field's comment. The example at the top is sweeps/smoke.yaml as it is on disk.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from fp8rl_core.config import HASH_EXCLUDE, RunConfig
from launchers.sweepfile.keys import ENGINE_OWNED
from launchers.sweepfile.schema import SweepSpec

START = "<!-- sweep-reference:start -->"
END = "<!-- sweep-reference:end -->"
ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = "sweeps/smoke.yaml"
REGENERATE = "python -m launchers.reference --write docs/sweep-reference.md"


@dataclass(frozen=True)
class Row:
    key: str  # dotted key as written in a sweep file (`launcher.slurm.time`, `search.params.<key>.low`)
    type: str  # readable type: `int`, `str or null`, "one of `a`, `b`", `list[float]`
    default: str  # the default as YAML, or "" for a section
    meaning: str  # the field's comment (Markdown; may be empty)


@dataclass(frozen=True)
class Section:
    key: str  # dotted key of the section ("" for the top level)
    intro: str  # class docstring, else the parent field's comment
    rows: tuple[Row, ...]


# ---- reading the code -------------------------------------------------------------------------------

@functools.cache
def _class_text(cls: type) -> tuple[str, dict[str, str]]:
    """(docstring, {field name: comment}) of a dataclass, from its source."""
    source = textwrap.dedent(inspect.getsource(cls))
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef), cls
    doc = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
    alone: dict[int, str] = {}  # line -> a comment that is the whole line
    trailing: dict[int, str] = {}  # line -> a comment after code
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            (alone if tok.line.strip().startswith("#") else trailing)[tok.start[0]] = text
    comments = {}
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            own = [trailing[n] for n in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1) if n in trailing]
            above, line = [], stmt.lineno - 1
            while line in alone:
                above.insert(0, alone[line])
                line -= 1
            comments[stmt.target.id] = " ".join(own or above)
    return doc, comments


def field_comment(cls: type, name: str) -> str:
    """The comment of field `name` of dataclass `cls` ("" when it has none)."""
    return _class_text(cls)[1].get(name, "")


def class_doc(cls: type) -> str:
    """First paragraph of the class docstring, on one line ("" when there is none)."""
    return _class_text(cls)[0]


# ---- rendering values and types ---------------------------------------------------------------------

def yaml_value(value: Any) -> str:
    """A value as it would be written in YAML: null, true, 3e-5, [0.9, 0.999], {}, "" for an empty string."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), repr(value))
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value)  # JSON is YAML flow style: ["+", "-"], [0.9, 0.999], {}
    return str(value)


def _section_type(tp: Any) -> type | None:
    """The dataclass a field holds (directly, optionally, or as the values of a mapping), else None."""
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        return tp
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _section_type(inner[0]) if len(inner) == 1 else None
    if origin is dict and args and dataclasses.is_dataclass(args[1]):
        return args[1]
    return None


def render_type(tp: Any) -> str:
    """A type annotation in words: `str or null`, "one of `a`, `b`", `list[float]`, `dict[str, any]`."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        text = " or ".join(render_type(a) for a in inner)
        return text + " or null" if len(inner) < len(args) else text
    if origin is Literal:
        return "one of " + ", ".join(f"`{yaml_value(a)}`" for a in args)
    if origin in (list, tuple):
        return f"list[{render_type(args[0])}]" if args else "list"
    if origin is dict:
        return f"dict[{render_type(args[0])}, {render_type(args[1])}]" if args else "dict"
    if dataclasses.is_dataclass(tp):
        return "section"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    return "" if dataclasses.is_dataclass(value) else f"`{yaml_value(value)}`"


# ---- walking the schema -----------------------------------------------------------------------------

def sections(root: type, prefix: str = "", intro: str = "",
             note: typing.Callable[[str], str] = lambda key: "") -> list[Section]:
    """`root`'s table, then (depth first, in field order) one per nested section.

    A dataclass field is a section `prefix.name`; a mapping of dataclasses is `prefix.name.<key>`.
    `note(key)` is appended to a row's meaning (e.g. "not part of the cell id")."""
    hints = typing.get_type_hints(root)
    rows, nested = [], []
    for f in dataclasses.fields(root):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        meaning = "; ".join(t for t in (field_comment(root, f.name), note(key)) if t)
        rows.append(Row(key, render_type(tp), _default(f), meaning))
        sub = _section_type(tp)
        if sub is not None:
            sub_key = key + (".<key>" if get_origin(tp) is dict else "")
            nested += sections(sub, sub_key + ".", class_doc(sub) or field_comment(root, f.name), note)
    return [Section(prefix.rstrip("."), class_doc(root) or intro, tuple(rows))] + nested


def run_config_note(key: str) -> str:
    """Where a run-config key stands with the sweep engine: outside the cell id, or set by it."""
    notes = []
    if any(key == x or key.startswith(x + ".") for x in HASH_EXCLUDE):
        notes.append("_not part of the cell id_")
    if key in ENGINE_OWNED:
        notes.append(f"_not in a sweep file: {ENGINE_OWNED[key]}_")
    return "; ".join(notes)


# ---- Markdown ---------------------------------------------------------------------------------------

def _cell(text: str) -> str:
    """Table-cell text: `|` escaped everywhere (GFM), `<`/`>` escaped outside code spans."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts).replace("|", "\\|")


def table(section: Section, heading: str) -> list[str]:
    """One section as Markdown: heading, intro line, table (key | type / allowed | default | meaning)."""
    out = [heading, ""]
    if section.intro:
        out += [_cell(section.intro), ""]
    out += ["| key | type / allowed | default | meaning |", "|---|---|---|---|"]
    out += [f"| `{r.key}` | {_cell(r.type)} | {_cell(r.default)} | {_cell(r.meaning)} |" for r in section.rows]
    return out + [""]


def _part(title: str, lead: str, secs: list[Section], top: str) -> list[str]:
    out = [f"### {title}", "", lead, ""]
    for s in secs:
        out += table(s, f"#### `{s.key}`" if s.key else f"#### {top}")
    return out


def generate(root: Path = ROOT) -> str:
    """The whole reference (Markdown, ending with a newline)."""
    example = (root / EXAMPLE).read_text().rstrip("\n")
    out = [f"<!-- generated by `python -m launchers.reference` from launchers/sweepfile/schema.py and "
           f"fp8rl_core/config/run_config.py (field comments); edit those, then run `{REGENERATE}` -->", "",
           f"A small but complete sweep file, `{EXAMPLE}`:", "", "```yaml", example, "```", ""]
    out += _part("Sweep-file keys", "The sections of a sweep file (launchers/sweepfile/schema.py). A key not set takes "
                 "its default; `sweep plan FILE key=value` overrides any of them.", sections(SweepSpec), "Top level")
    out += _part("Run-config keys", "What one cell runs (fp8rl_core/config/run_config.py): nested under `base:`, "
                 "or dotted (`loss.importance_sampling`) in `grid`, `zip`, `exclude` and `search.params`. Keys marked "
                 "_not part of the cell id_ (`HASH_EXCLUDE`) say where to write, not what to compute, so they "
                 "cannot be varied.", sections(RunConfig, note=run_config_note), "Top level (run config)")
    return "\n".join(out).rstrip("\n") + "\n"


# ---- the generated block in a file--------------------------------------------------------------------------

def _split(text: str, name: str) -> tuple[str, str, str]:
    """(before START, between the markers, from END on); SystemExit naming the file when they are missing."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SystemExit(f"{name}: needs exactly one {START} followed by one {END}")
    head, rest = text.split(START)
    body, tail = rest.split(END)
    return head, body, END + tail


def check(path: Path, generated: str | None = None) -> str:
    """A unified diff of the file's reference block against the generated one ("" when up to date)."""
    _, body, _ = _split(path.read_text(), str(path))
    want = "\n" + (generate() if generated is None else generated)
    return "".join(difflib.unified_diff(body.splitlines(True), want.splitlines(True),
                                        f"{path} (current)", f"{path} (generated)"))


def write(path: Path, generated: str | None = None) -> bool:
    """Replace the block between the markers; True when the file changed."""
    text = path.read_text()
    head, _, tail = _split(text, str(path))
    new = head + START + "\n" + (generate() if generated is None else generated) + tail
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launchers.reference", description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", metavar="FILE", type=Path, help=f"replace the text between {START} and {END}")
    g.add_argument("--check", metavar="FILE", type=Path, help="exit 1 with a diff when FILE's reference is stale")
    args = p.parse_args(argv)
    if args.write:
        print(f"{args.write}: {'updated' if write(args.write) else 'already up to date'}")
    elif args.check:
        diff = check(args.check)
        if diff:
            sys.stdout.write(diff)
            print(f"{args.check}: the sweep-file reference is stale; run: "
                  f"python -m launchers.reference --write {args.check}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(generate())
    return 0


if __name__ == "__main__":
    sys.exit(main())
