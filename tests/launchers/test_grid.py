"""Grid expansion and cells: order, zip, exclusions, ids and resolved configs against an independent path.

The reference for every cell is the obvious implementation: the base mapping plus the cell's values
as `key=value` overrides, built with fp8rl_core.config.run_config_from_dict and hashed with
run_config_hash (what a single run would do with the same settings).
"""
from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8rl_core.config import run_config_from_dict, run_config_hash
from fp8rl_core.config.schema import set_dotted, to_dict
from launchers.plan import grid
from launchers.plan.cells import cell_run_config, cell_tags
from launchers.plan.grid import cell_for, expand, expand_grid
from launchers.sweepfile.loading import load_sweep_text
from launchers.sweepfile.schema import SweepError

REPO = Path(__file__).resolve().parents[2]


def sweep_of(text: str, overrides=(), **kw):
    return load_sweep_text(text, "t.yaml", list(overrides), **kw)


def reference(sweep, params):
    """Independent path: the values set on a copy of the base mapping -> full build -> hash."""
    data = copy.deepcopy(sweep.base_data)
    for key, value in params.items():
        set_dotted(data, key, value)
    cfg = run_config_from_dict(data)
    return cfg, run_config_hash(cfg)


def assert_cells_match_reference(sweep, cells):
    for cell in cells:
        cfg, cid = reference(sweep, cell.params)
        assert cell.id == cid == run_config_hash(cell.config)
        assert to_dict(cell.config) == to_dict(cfg)


STUDY = """experiment: t
base: {train: {steps: 3}, loss: {is_cap: 3}}
grid:
  recipe: [bf16, fp8_gen, fp8_e2e]
  loss.importance_sampling: [none, token]
  seed: [0, 1]
"""


def test_product_in_file_order_last_key_fastest():
    cells = expand(sweep_of(STUDY))
    expected = list(itertools.product(["bf16", "fp8_gen", "fp8_e2e"], ["none", "token"], [0, 1]))
    assert [tuple(c.params.values()) for c in cells] == expected
    assert [c.index for c in cells] == list(range(12))
    assert list(cells[0].params) == ["recipe", "loss.importance_sampling", "seed"]


def test_cells_equal_independent_builds():
    sweep = sweep_of(STUDY)
    assert_cells_match_reference(sweep, expand(sweep))
    assert all(c.config.loss.is_cap == 3.0 and c.config.train.steps == 3 for c in expand(sweep))


def test_repo_sweeps_cells_equal_independent_builds():
    for name in ("smoke.yaml", "fp8_ablation.yaml", "fp8_ablation_llama8b.yaml"):
        sweep = load_sweep_text((REPO / "sweeps" / name).read_text(), name)
        assert_cells_match_reference(sweep, expand(sweep))


def test_ids_do_not_depend_on_order_position_or_other_cells():
    ids = {c.id for c in expand(sweep_of(STUDY))}
    reordered = STUDY.replace("  recipe: [bf16, fp8_gen, fp8_e2e]\n", "") + "  recipe: [fp8_e2e, bf16, fp8_gen]\n"
    assert {c.id for c in expand(sweep_of(reordered))} == ids
    grown = expand(sweep_of(STUDY, ["grid.seed=[0, 1, 2]"]))
    assert ids < {c.id for c in grown} and len(grown) == 18


def test_int_and_float_spellings_are_one_cell():
    """1 and 1.0 for a float field type to the same value, so the id is the same."""
    a = expand(sweep_of("experiment: t\ngrid: {optim.lr: [1, 2]}\n"))
    b = expand(sweep_of("experiment: t\ngrid: {optim.lr: [1.0, 2.0]}\n"))
    assert [c.id for c in a] == [c.id for c in b]
    assert a[0].params["optim.lr"] == 1.0 and isinstance(a[0].params["optim.lr"], float)


def test_base_value_equal_to_grid_value_is_the_same_cell_as_without_grid():
    """A cell's id is its resolved config: varying a key to its base value changes nothing."""
    single = expand(sweep_of("experiment: t\nbase: {seed: 5}\ngrid: {recipe: [bf16]}\n"))
    varied = expand(sweep_of("experiment: t\ngrid: {recipe: [bf16], seed: [5]}\n"))
    assert single[0].id == varied[0].id


def test_zip_varies_keys_together():
    text = STUDY + "zip:\n  - {optim.lr: [1e-4, 3e-4, 3e-4], train.steps: [10, 20, 30]}\n"
    sweep = sweep_of(text)
    cells = expand(sweep)
    assert len(cells) == 12 * 3
    pairs = {(c.params["optim.lr"], c.params["train.steps"]) for c in cells}
    assert pairs == {(1e-4, 10), (3e-4, 20), (3e-4, 30)}
    assert_cells_match_reference(sweep, cells[:6])


def test_exclusions_single_values_and_any_of():
    text = (STUDY + "exclude:\n  - {recipe: bf16, loss.importance_sampling: token}\n"
            "  - {recipe: [fp8_gen, fp8_e2e], seed: 1}\n")
    exp = expand_grid(sweep_of(text))
    kept = {tuple(c.params.values()) for c in exp.cells}
    expected = {(r, i, s) for r, i, s in itertools.product(["bf16", "fp8_gen", "fp8_e2e"], ["none", "token"], [0, 1])
                if not (r == "bf16" and i == "token") and not (r != "bf16" and s == 1)}
    assert kept == expected and (exp.combinations, exp.excluded) == (12, 12 - len(expected))


def test_exclusion_on_a_list_field_matches_the_whole_list():
    text = ("experiment: t\ngrid:\n  task.operators: [['+'], ['+', '-'], ['*']]\n"
            "exclude:\n  - {task.operators: ['+', '-']}\n")
    assert [c.params["task.operators"] for c in expand(sweep_of(text))] == [["+"], ["*"]]
    any_of = text.replace("{task.operators: ['+', '-']}", "{task.operators: [['+'], ['*']]}")
    assert [c.params["task.operators"] for c in expand(sweep_of(any_of))] == [["+", "-"]]


def test_exclusion_keys_inside_zip_groups():
    text = ("experiment: t\ngrid: {seed: [0, 1]}\nzip:\n  - {optim.lr: [1e-4, 3e-4], train.steps: [10, 20]}\n"
            "exclude:\n  - {train.steps: 20, seed: 1}\n")
    cells = expand(sweep_of(text))
    assert sorted((c.params["seed"], c.params["train.steps"]) for c in cells) == [(0, 10), (0, 20), (1, 10)]


def test_combination_errors_name_the_cell_and_line():
    text = "experiment: t\ngrid:\n  task.min_digits: [1, 2]\n  task.digits: [1, 3]\n"
    where = r"t.yaml:4: grid.task.digits: .*in the cell \{task.min_digits: 2, task.digits: 1\}"
    with pytest.raises(SweepError, match=where):
        expand(sweep_of(text))


def test_too_many_cells_is_an_error(monkeypatch):
    monkeypatch.setattr(grid, "MAX_CELLS", 5)
    with pytest.raises(SweepError, match="12 combinations is more than 5"):
        expand(sweep_of(STUDY))


def test_cell_run_config_sets_where_to_write_and_the_mlflow_tags(tmp_path):
    sweep = sweep_of(STUDY, cwd=tmp_path)
    cell = expand(sweep)[3]
    cfg = cell_run_config(sweep, cell, run_id="r1", parent_run_id="p0")
    assert cfg.output_dir == str(tmp_path / "outputs" / "t" / "cells" / cell.id)
    assert (cfg.tracking.uri, cfg.tracking.experiment) == (f"sqlite:///{tmp_path}/mlflow.db", "t")
    assert (cfg.tracking.run_id, cfg.tracking.parent_run_id) == ("r1", "p0")
    assert cfg.tracking.tags == cell_tags(sweep, cell) == {
        "sweep": "t", "cell_id": cell.id, "recipe": "bf16", "importance_sampling": "token", "seed": "1"}
    assert run_config_hash(cfg) == cell.id and cell.config.output_dir != cfg.output_dir  # cell left intact
    # the warm-start cache is resolved here, once: the driver logs this config as the run's params and
    # every attempt runs it (issue 24: a cache made absolute later changed a logged param)
    assert cfg.warmstart.cache_dir == str(tmp_path / ".fp8rl" / "warmstart")


def test_search_trial_cells():
    sweep = load_sweep_text((REPO / "sweeps" / "lr_search.yaml").read_text(), "lr.yaml")
    cell = cell_for(sweep, {"optim.lr": 3e-4, "loss.is_cap": 4}, index=7)
    cfg, cid = reference(sweep, {"optim.lr": 3e-4, "loss.is_cap": 4.0})
    assert (cell.id, cell.index, cell.config.loss.is_cap) == (cid, 7, 4.0)
    assert to_dict(cell.config) == to_dict(cfg)
    with pytest.raises(SweepError, match="search.params.optim.lrr: unknown run-config key"):
        cell_for(sweep, {"optim.lrr": 1e-3})


VALUES = {
    "recipe": st.sampled_from(["bf16", "fp8_gen", "fp8_e2e"]),
    "seed": st.integers(0, 10**6),
    "optim.lr": st.floats(1e-7, 1.0),
    "loss.importance_sampling": st.sampled_from(["none", "token", "tis", "icepop", "sequence"]),
    "rollout.temperature": st.floats(0.1, 2.0),
    "task.digits": st.integers(3, 9),
    "fp8.power_of_two_scales": st.booleans(),
}


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(VALUES)), st.just(None), min_size=1, max_size=3).flatmap(
    lambda keys: st.fixed_dictionaries({k: st.lists(VALUES[k], min_size=1, max_size=3, unique=True) for k in keys})))
def test_random_grids_match_independent_builds(grid_values):
    sweep = sweep_of(yaml.safe_dump({"experiment": "t", "base": {"train": {"steps": 2}}, "grid": grid_values}))
    cells = expand(sweep)
    assert len(cells) == len({c.id for c in cells})
    for cell in cells[:: max(1, len(cells) // 5)]:
        cfg, cid = reference(sweep, cell.params)
        assert cell.id == cid and to_dict(cell.config) == to_dict(cfg)
