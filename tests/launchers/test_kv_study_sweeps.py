"""The FP8 KV cache study's sweep files (issue 34), declared and not run: both load, validate every cell's run
config and plan — the KV designs paired by seed, the corrections on NVFP4 generation."""
from __future__ import annotations

from pathlib import Path

import pytest

from launchers.plan.grid import expand_grid
from launchers.plan.render import render_plan
from launchers.sweepfile.loading import load_sweep

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name,cells,arms", [
    ("fp8_kv_cache", 24, {("auto", "trainer"), ("e4m3", "trainer"), ("e4m3", "first_forward"),
                          ("e4m3", "per_token_head")}),
    ("fp8_corrections", 36, {"none", "token", "tis", "icepop", "seq_mask", "dppo"})])
def test_the_kv_study_sweeps_load_and_plan(monkeypatch, name, cells, arms):
    monkeypatch.chdir(REPO)
    sweep = load_sweep(f"sweeps/{name}.yaml")
    grid = expand_grid(sweep)
    assert len(grid.cells) == cells and sweep.spec.analysis["kind"] == "numerics"
    configs = [c.config for c in grid.cells]
    assert {c.seed for c in configs} == set(range(6)) and {c.fp8.gemm for c in configs} == {"emulated"}
    if name == "fp8_kv_cache":
        assert {c.recipe for c in configs} == {"fp8_e2e"} and {c.fp8.kv_quantize_from for c in configs} == {"bf16"}
        assert {(c.fp8.kv_cache, c.fp8.kv_scale) for c in configs} == arms
    else:
        assert {(c.recipe, c.fp8.format) for c in configs} == {("fp8_gen", "nvfp4")}
        assert {c.loss.importance_sampling for c in configs} == arms
    assert f"cells: {cells} ({cells} combinations, 0 excluded)" in render_plan(sweep, grid, provider=lambda ids: {})
