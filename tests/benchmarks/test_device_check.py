"""benchmarks/device_check.sh --cpu: every phase of the device check runs on the CPU (tiny sizes, gloo, the
emulated executor) and writes its rows as it goes; the check's import chain needs none of the packages
the lent GPU machine lacks; a killed run keeps its rows and says it was killed.

The import chain is proven with an import blocker (a sys.meta_path finder that refuses mlflow, submitit,
pytest, vllm, transformer_engine and megatron, as if they were not installed) around a full --cpu run.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8rl_core.fp8 import select_executor

ROOT = Path(__file__).resolve().parents[2]
SH = ROOT / "benchmarks" / "device_check.sh"
PHASES = ("env", "preflight", "linear", "grpo", "fsdp", "megatron")
ABSENT_ON_THE_GPU_MACHINE = ("mlflow", "submitit", "pytest", "vllm", "transformer_engine", "megatron")


def device_check(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SH), *args], capture_output=True, text=True, env=environ, timeout=timeout,
                          cwd=ROOT)


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "device_check.jsonl").read_text().splitlines()]


def check_every_phase(out: Path, allowed_skips: dict[str, str] | None = None) -> list[dict]:
    """Every phase has a row, every row is ok or skipped with a reason, the run ended; the Markdown and the
    log have every row."""
    rows = rows_of(out)
    assert rows[-1]["phase"] == "end" and rows[-1]["case"] == "total", rows[-1]
    bad = [r for r in rows if r["status"] not in ("ok", "skipped")]
    assert not bad, "\n".join(f"{r['phase']} / {r['case']}: {r['status']}: {r['note']}" for r in bad)
    for phase in PHASES:
        assert any(r["phase"] == phase for r in rows), f"no row of phase {phase}"
    for r in rows:
        if r["status"] == "skipped":
            assert r["note"], r
    md, log = (out / "device_check.md").read_text(), (out / "device_check.log").read_text()
    for r in rows:
        assert f"| {r['phase']} | {r['case']} | {r['status']} |" in md
        assert f"| {r['phase']} | {r['case']} |" in log
    return rows


@pytest.mark.slow
def test_cpu_smoke_runs_every_phase(tmp_path):
    out = tmp_path / "out"
    proc = device_check("--cpu", str(out), "--strict")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = check_every_phase(out)
    by = {(r["phase"], r["case"]): r for r in rows}
    assert by[("env", "imports")]["status"] == "ok"
    chosen = select_executor("cpu")  # the executor under test (gpu_phases/gemm.py hardware_executor)
    under_test = "emulated_blockwise" if chosen == "emulated" else chosen
    linear = [r for r in rows if r["phase"] == "linear" and r["case"].startswith(f"Fp8Linear [{under_test}]")]
    assert len(linear) == 2 and all(0 <= r["max_rel_diff"] < 1e-2 for r in linear)  # eager and compiled
    grpo = {r["case"]: r for r in rows if r["phase"] == "grpo"}
    for recipe in ("bf16", "fp8_gen", "fp8_e2e"):
        r = grpo[f"GRPO step [{recipe}]"]
        assert r["status"] == "ok" and r["time_ms"] > 0 and 1.0 <= r["tmpe"] < 1.5 and r["plan_gib"] > 0
    assert grpo["GRPO step [bf16]"]["ratio"] == 1.0
    plan = [r for r in rows if r["case"].startswith("8B plan: ")]
    assert [r["case"] for r in plan[:2]] == ["8B plan: shapes", "8B plan: scaled_mm layouts (meta)"]
    assert len(plan) == 2 + 12 + 1 and all(r["status"] == "ok" for r in plan)  # 12 CPU shapes, then the summary
    assert plan[1]["note"].startswith("24 of 24 8B shapes") and plan[-1]["case"] == "8B plan: all shapes"
    assert all(r["time_ms"] > 0 and r["ratio"] <= 1 for r in plan[2:])
    reach = by[("env", "out of reach")]
    assert reach["status"] == "skipped" and "GPU path" in reach["note"] and "test_vllm_real.py" in reach["note"]
    fsdp = [r for r in rows if r["phase"] == "fsdp"]
    assert [r["status"] for r in fsdp] == ["ok"] * 5
    mega = [r for r in rows if r["phase"] == "megatron"]
    assert len(mega) == 1 and (mega[0]["status"] == "ok" or "not installed" in mega[0]["note"])


@pytest.mark.slow
def test_import_chain_needs_none_of_the_packages_the_gpu_machine_lacks(tmp_path):
    """The whole --cpu check in a process where mlflow, submitit, pytest, vllm, Transformer Engine and
    Megatron cannot be imported (find_spec finds nothing): it passes, and Megatron's phase says why it skipped."""
    out = tmp_path / "out"
    blocker = f"""
import importlib.abc, runpy, sys
BLOCKED = {ABSENT_ON_THE_GPU_MACHINE!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: absent on the GPU machine)", name=name)
        return None
sys.meta_path.insert(0, Blocker())
sys.argv = ["gpu_check.py", "--cpu", "--strict", "--out-dir", {str(out)!r}]
runpy.run_path({str(ROOT / "benchmarks" / "gpu_check.py")!r}, run_name="__main__")
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, env=env, timeout=240,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = rows_of(out)
    assert all(r["status"] in ("ok", "skipped") for r in rows), [r for r in rows if r["status"] not in ("ok",
                                                                                                      "skipped")]
    by = {(r["phase"], r["case"]): r for r in rows}
    imports = by[("env", "imports")]
    assert imports["data"]["imported_eagerly"] == [] and imports["data"]["failed"] == {}
    assert not any(imports["data"]["optional_installed"].values())
    reach = by[("env", "out of reach")]["note"]
    assert reach.startswith("vLLM and Transformer Engine: out of reach on this machine (not installed")
    assert "their GPU paths are unverified here" in reach and reach in (out / "device_check.md").read_text()
    assert "not installed: megatron-core" in by[("megatron", "Megatron-Core BF16 vs native")]["note"]
    assert by[("grpo", "GRPO step [fp8_e2e]")]["status"] == "ok"


def test_a_killed_run_keeps_its_rows_and_says_so(tmp_path):
    out = tmp_path / "out"
    proc = device_check("--cpu", str(out), "--phases", "env,grpo", "--steps", "100000", timeout=120,
                        DEVICE_CHECK_TIMEOUT="6")
    assert proc.returncode in (124, 137), proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = rows_of(out)  # every line is whole JSON
    assert rows[-1]["case"] == "killed" and rows[-1]["status"] == "error"
    assert "killed at 6 s (DEVICE_CHECK_TIMEOUT) during " in rows[-1]["note"]
    assert all(set(r) == set(rows[0]) for r in rows)
    assert "| end | killed | error |" in (out / "device_check.md").read_text()


def test_a_crash_is_an_error_row_and_the_check_goes_on_with_the_next_phase(tmp_path):
    """A process death no row can report (here an injected abort, as a segfaulting kernel would) ends one
    process; device_check.sh starts another with --resume: the dead case gets an error row, the next phase runs."""
    out = tmp_path / "out"
    proc = device_check("--cpu", str(out), "--phases", "env,linear,megatron", timeout=120,
                        FP8RL_DEVICE_CHECK_ABORT_AT="linear/eager M=K=N=128")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the check died (exit 134); going on with the next phase" in proc.stderr
    rows = rows_of(out)
    assert [r["phase"] for r in rows] == ["env"] * 4 + ["linear", "megatron", "end"]
    died = rows[4]
    assert died["status"] == "error" and died["case"] == "process died in: eager M=K=N=128"
    assert "signal 6" in died["note"] and "rest of phase linear was not run" in died["note"]
    assert rows[-1]["data"]["error"] == 1 and "(resumed: 4 rows kept)" in (out / "device_check.log").read_text()


def test_usage_errors():
    proc = device_check(timeout=30)
    assert proc.returncode == 2 and "usage: bash benchmarks/device_check.sh [--cpu] OUT_DIR" in proc.stderr
    proc = device_check("--cpu", "--strict", timeout=30)
    assert proc.returncode == 2 and "usage" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_without_cuda_and_without_cpu_flag_it_says_so(tmp_path):
    proc = device_check(str(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.stderr
    (only,) = rows_of(tmp_path)
    assert only["status"] == "skipped" and "no CUDA GPU" in only["note"]
