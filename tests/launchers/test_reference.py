"""The generated sweep-file reference: docs/sweep-reference.md is up to date, every schema field is in it, and the
generator reads types, defaults and comments as written (checked on a small dataclass of our own)."""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from fp8rl_core.config import RunConfig
from launchers import reference
from launchers.reference import END, START, Row, Section
from launchers.sweepfile.schema import SweepSpec

REPO = Path(__file__).resolve().parents[2]

Mode = Literal["fast", "exact"]


@dataclass
class _Inner:
    depth: int = 3  # how deep


@dataclass
class _Synthetic:
    """A section for the test.

    Only the first paragraph is the intro."""
    mode: Mode = "fast"  # which mode | to run
    # the weights, one per layer,
    # as a list
    weights: list[float] = field(default_factory=lambda: [0.5, 1.0])
    name: str | None = None
    lr: float = 3e-5  # step size (< 1)
    inner: _Inner = field(default_factory=_Inner)  # a nested section
    by_name: dict[str, _Inner] = field(default_factory=dict)  # named sections
    maybe: _Inner | None = None


def test_readme_reference_is_up_to_date():
    diff = reference.check(REPO / "docs" / "sweep-reference.md")
    assert not diff, f"docs/sweep-reference.md is stale; run: {reference.REGENERATE}\n{diff}"


def _schema_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of `cls`, walked with dataclasses.fields (a mapping of dataclasses: `.<key>`)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        keys.append(key)
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if dataclasses.is_dataclass(tp):
            keys += _schema_keys(tp, key + ".")
        elif typing.get_origin(tp) in (typing.Union, types.UnionType) and dataclasses.is_dataclass(args[0]):
            keys += _schema_keys(args[0], key + ".")
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(args[1]):
            keys += _schema_keys(args[1], key + ".<key>.")
    return keys


def _table_keys(markdown: str, heading: str) -> list[str]:
    """Keys of the table rows under `### heading` (up to the next `### `)."""
    part = markdown.split(f"### {heading}\n", 1)[1].split("\n### ", 1)[0]
    return [line.split("`")[1] for line in part.splitlines() if line.startswith("| `")]


def test_every_schema_field_has_one_row():
    text = reference.generate()
    assert sorted(_table_keys(text, "Sweep-file keys")) == sorted(_schema_keys(SweepSpec))
    assert sorted(_table_keys(text, "Run-config keys")) == sorted(_schema_keys(RunConfig))
    assert len(_schema_keys(RunConfig)) > 60 and len(_schema_keys(SweepSpec)) > 30


def test_every_schema_field_has_a_comment():
    missing = [f"{s.key or '<top>'}: {r.key}" for root in (SweepSpec, RunConfig)
               for s in reference.sections(root) for r in s.rows if not r.meaning]
    assert not missing, "add a trailing `# comment` to these fields (then regenerate docs/sweep-reference.md):\n" + \
        "\n".join(missing)


def test_hash_excluded_and_engine_owned_keys_are_marked():
    rows = {r.key: r for s in reference.sections(RunConfig, note=reference.run_config_note) for r in s.rows}
    assert "not part of the cell id" in rows["warmstart.cache_dir"].meaning
    assert "not part of the cell id" in rows["tracking.tags"].meaning  # under an excluded section
    assert "not in a sweep file" in rows["tracking.run_id"].meaning
    assert "not part of the cell id" not in rows["warmstart.steps"].meaning


def test_the_example_is_smoke_yaml_as_on_disk():
    assert (REPO / "sweeps" / "smoke.yaml").read_text().rstrip("\n") in reference.generate()


def test_synthetic_dataclass_rows():
    secs = reference.sections(_Synthetic, "s.")
    assert [s.key for s in secs] == ["s", "s.inner", "s.by_name.<key>", "s.maybe"]
    assert secs[0] == Section("s", "A section for the test.", (
        Row("s.mode", "one of `fast`, `exact`", "`fast`", "which mode | to run"),
        Row("s.weights", "list[float]", "`[0.5, 1.0]`", "the weights, one per layer, as a list"),
        Row("s.name", "str or null", "`null`", ""),
        Row("s.lr", "float", "`3e-5`", "step size (< 1)"),
        Row("s.inner", "section", "", "a nested section"),
        Row("s.by_name", "dict[str, section]", "`{}`", "named sections"),
        Row("s.maybe", "section or null", "`null`", ""),
    ))
    assert secs[1] == Section("s.inner", "a nested section", (Row("s.inner.depth", "int", "`3`", "how deep"),))
    assert secs[2].rows[0].key == "s.by_name.<key>.depth"
    lines = reference.table(secs[0], "#### s")
    assert "| `s.mode` | one of `fast`, `exact` | `fast` | which mode \\| to run |" in lines
    assert "| `s.lr` | float | `3e-5` | step size (&lt; 1) |" in lines


def test_write_then_check(tmp_path, capsys):
    doc = tmp_path / "DOC.md"
    doc.write_text(f"# Title\n\nkept\n\n{START}\nold text\n{END}\n\ntail\n")
    assert reference.main(["--check", str(doc)]) == 1
    assert "-old text" in capsys.readouterr().out
    assert reference.main(["--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\nkept\n\n" + START + "\n") and text.endswith(END + "\n\ntail\n")
    assert "old text" not in text and "| `launcher.slurm.time` |" in text
    assert reference.main(["--check", str(doc)]) == 0


def test_missing_markers_name_the_file(tmp_path):
    doc = tmp_path / "DOC.md"
    doc.write_text(f"no markers here\n{END}\n{START}\n")
    with pytest.raises(SystemExit, match="DOC.md: needs exactly one"):
        reference.check(doc)
