"""benchmarks/gpu_check.py end to end on the CPU (--allow-cpu, tiny sizes), in a subprocess as a user runs it.

Checks that every section produced its rows (section a's three GEMM rows per size, one GRPO-step row
per recipe, the optional-backend rows), the JSON mirrors the Markdown table, and the numbers are sane
(FP8 executors agree to ~1e-2 normwise; the mismatch metric is >= 1 by definition).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, even on a GPU box
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_without_cuda_it_runs_nothing_and_exits_0(tmp_path):
    proc = run("--out", str(tmp_path / "r.json"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU here" in proc.stdout and "--allow-cpu" in proc.stdout
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == []


@pytest.mark.slow
def test_allow_cpu_smoke_produces_every_row(tmp_path):
    out = tmp_path / "r.json"
    proc = run("--allow-cpu", "--sizes", "128", "--recipes", "bf16", "fp8_e2e", "--steps", "1", "--strict",
               "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {r["case"]: r for r in report["rows"]}
    assert all(r["status"] in ("ok", "skipped") for r in report["rows"]), report["rows"]
    a = [r for r in report["rows"] if r["section"] == "a"]
    assert [r["case"] for r in a] == ["nn.Linear bf16 fwd+bwd M=K=N=128",
                                      "Fp8Linear [emulated_blockwise] fwd+bwd M=K=N=128",
                                      "Fp8Linear [emulated] fwd+bwd M=K=N=128"]
    assert 0 < a[1]["max_rel_diff"] < 1e-2 and a[0]["ratio"] == 1.0 and a[1]["time_ms"] > 0
    for recipe in ("bf16", "fp8_e2e"):
        r = rows[f"GRPO step tiny [{recipe}] native engines"]
        assert r["status"] == "ok" and r["time_ms"] > 0 and 1.0 <= r["tmpe"] < 1.5
    assert rows["GRPO step tiny [bf16] native engines"]["ratio"] == 1.0
    for label in ("vLLM generation", "Megatron-Core training"):
        assert rows[label]["status"] == "skipped"  # CUDA is hidden: never runnable here
    if importlib_missing("vllm"):
        assert "not installed" in rows["vLLM generation"]["note"]
    table = proc.stdout[proc.stdout.index("| section |"):]
    assert all(f"| {r['case']} |" in table for r in report["rows"])
    assert torch.__version__ == report["torch"]


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


# --- time limits: the overall deadline and the per-section budgets turn cases that may not start into
# `skipped` rows naming the limit; the clock itself is tested with a fake time source

def test_without_cuda_it_says_what_it_skipped(tmp_path):
    proc = run(timeout=60)
    assert proc.returncode == 0 and "skipped: sections a, b, c: no CUDA GPU" in proc.stdout


def test_an_exhausted_deadline_skips_every_case_and_says_why(tmp_path):
    out = tmp_path / "r.json"
    proc = run("--allow-cpu", "--deadline", "0", "--sections", "a,b", "--sizes", "128", "--recipes", "bf16",
               "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["rows"] and all(r["status"] == "skipped" for r in report["rows"])
    assert all("overall deadline" in r["note"] for r in report["rows"])
    assert report["deadline_s"] == 0 and report["sections_not_selected"] == ["c"]
    tail = proc.stdout[proc.stdout.index("skipped:"):]
    assert "- section c: not selected" in tail and "[a] Fp8Linear M=K=N=128: not started: overall deadline" in tail


def test_section_budget_skips_only_that_section(tmp_path):
    out = tmp_path / "r.json"
    proc = run("--allow-cpu", "--budgets", "a=0", "--sections", "a", "--sizes", "128,64", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert all("section a budget" in r["note"] and "--budgets a=" in r["note"] for r in rows)


def test_clock_with_a_fake_time_source():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    now = [0.0]
    clock = gpu_check.Clock(100.0, {"a": 30.0, "b": 50.0}, now=lambda: now[0])
    assert clock.why_not("a") is None
    now[0] = 27.0
    assert "section a budget: 3 s left of 30 s" in clock.why_not("a")
    assert clock.why_not("b") is None and clock.timeout("b", 300.0) == 50.0  # b's budget starts when b does
    now[0] = 60.0
    assert clock.timeout("b", 300.0) == 17.0 and clock.timeout("b", 10.0) == 10.0
    now[0] = 97.0
    assert "overall deadline: 3 s left of 100 s" in clock.why_not("b")
    assert gpu_check.parse_budgets("a=10") == {"a": 10.0, "b": 150.0, "c": 240.0}
