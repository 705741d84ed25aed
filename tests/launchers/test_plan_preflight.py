"""`sweep plan --preflight` (launchers/plan/preflight.py): each cell's FP8 GEMM shapes from its model's config
alone, checked on this machine (a CPU: at a small M only, so the 8B sweep stays fast)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from fp8rl_core.fp8 import preflight
from launchers import cli

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
# Llama-3.1-8B-Instruct's config.json (the architecture only: no weights are read); one copy, the device check's
from gpu_phases.models import LLAMA_8B  # noqa: E402


def plan(capsys, *args):
    rc = cli.main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def llama8b(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "Llama-3.1-8B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))
    return [str(REPO / "sweeps" / "fp8_ablation_llama8b.yaml"), f"base.model.path={model}"]


@pytest.mark.slow  # ~10-30 s on a loaded 2-core machine: 8B weights' worth of random data, at M = 5
def test_llama8b_lists_each_cells_shapes_and_checks_them_at_a_small_m(llama8b, capsys):
    t0 = time.perf_counter()
    rc, out, err = plan(capsys, *llama8b, "--preflight")
    seconds = time.perf_counter() - t0
    assert rc == 0, err
    section = out[out.index("FP8 GEMM preflight"):]
    # bf16 and fp8_gen (vLLM generation) cells run no FP8 GEMM of ours; fp8_e2e's native FSDP2 trainer does
    assert "8 cell(s)" in section and "nothing to check" in section
    assert "4 cell(s)" in section and "24 shapes" in section and "8 rank(s)" in section
    for row in ("gate_proj/up_proj  wgrad  4608  4096   14336", "down_proj          dgrad  256   14336  4096",
                "q_proj/o_proj      fprop  256   4096   4096"):
        # M: 64 x 32 / 8 = 256 rows decoded per rank; 1 x (512 + 4096) training tokens, the prompt length
        # max_model_len allows (issue 31: not the arithmetic task's 64)
        assert row in section
    assert "checked here on cpu, at M=5 only" in section and "12 shapes passed" in section
    assert seconds < 240


def test_an_unreadable_model_config_is_shown_not_guessed(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = plan(capsys, str(REPO / "sweeps" / "fp8_ablation_llama8b.yaml"),
                      "base.model.path=/nowhere/Llama-3.1-8B-Instruct", "--preflight")
    assert rc == 0
    assert "? model /nowhere/Llama-3.1-8B-Instruct, cuda, 8 rank(s): model config not readable here" in out
    assert "nothing to check here" in out


def test_a_failing_shape_fails_the_plan(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text("experiment: t\nbase: {recipe: fp8_e2e, device: cpu}\ngrid: {seed: [0, 1]}\n")
    real = preflight.blockwise_scaled_mm
    monkeypatch.setattr(preflight, "blockwise_scaled_mm",
                        lambda qa, sa, qb, sb, **kw: real(qa, sa, qb, sb, **kw) * (2 if qa.shape[1] == 768 else 1))
    rc, out, _ = plan(capsys, "s.yaml", "--preflight")
    assert rc == 1
    assert "2 cell(s)" in out and "28 shapes (model preset tiny, cpu, 1 rank(s))" in out
    assert "FAILED" in out and "down_proj fprop M=5 K=768 N=256" in out
    assert "FP8 GEMM preflight" not in plan(capsys, "s.yaml")[1]  # only when asked
