"""benchmarks/gpu_check.py's parts that need no GPU: the no-CUDA exit, the time limits, the preflight phase
against a fake preflight module (issue 22 part 2's API), and the row/report format.

The whole check on the CPU (`device_check.sh --cpu`) is tests/benchmarks/test_device_check.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
from gpu_phases import common, gemm  # noqa: E402


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, even on a GPU box
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / common.JSONL).read_text().splitlines()]


def test_without_cuda_it_runs_nothing_says_so_and_exits_0(tmp_path):
    proc = run("--out", str(tmp_path / "r.json"), "--out-dir", str(tmp_path / "out"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA GPU here" in proc.stdout and "--cpu" in proc.stdout
    assert "skipped: phases env, preflight, linear, grpo, fsdp, megatron: no CUDA GPU" in proc.stdout
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == []
    (only,) = jsonl(tmp_path / "out")
    assert only["status"] == "skipped" and "no CUDA GPU" in only["note"]


# --- time limits: the overall deadline and the per-phase budgets turn cases that may not start into
# `skipped` rows naming the limit; the clock itself is tested with a fake time source

def test_an_exhausted_deadline_skips_every_case_and_says_why(tmp_path):
    out = tmp_path / "out"
    proc = run("--cpu", "--deadline", "0", "--phases", "env,linear", "--out-dir", str(out), "--out",
               str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = jsonl(out)
    assert [r["phase"] for r in rows] == ["env"] * 3 + ["linear"] * 2 + ["end"]
    assert rows[-1]["data"] == {"ok": 0, "fail": 0, "error": 0, "skipped": 5}
    assert all(r["status"] == "skipped" and "overall deadline" in r["note"] for r in rows[:-1])
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["deadline_s"] == 0 and report["phases_not_selected"] == ["preflight", "grpo", "fsdp", "megatron"]
    md = (out / common.MARKDOWN).read_text()
    assert "- phase grpo: not selected" in md and "[linear] eager M=K=N=128: not started: overall deadline" in md


def test_phase_budget_skips_only_that_phase(tmp_path):
    out = tmp_path / "out"
    proc = run("--cpu", "--budgets", "linear=0", "--phases", "env,linear", "--sizes", "128,64", "--out-dir", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = jsonl(out)
    assert [r["status"] for r in rows if r["phase"] == "env"] == ["ok"] * 3
    linear = [r for r in rows if r["phase"] == "linear"]
    assert len(linear) == 4 and all("phase linear budget" in r["note"] and "--budgets linear=" in r["note"]
                                    for r in linear)


def test_clock_with_a_fake_time_source():
    now = [0.0]
    clock = gpu_check.Clock(100.0, {"env": 30.0, "grpo": 50.0}, now=lambda: now[0])
    assert clock.why_not("env") is None
    now[0] = 27.0
    assert "phase env budget: 3 s left of 30 s" in clock.why_not("env")
    assert clock.why_not("grpo") is None  # grpo's budget starts when grpo does
    now[0] = 97.0
    assert "overall deadline: 3 s left of 100 s" in clock.why_not("grpo")
    assert gpu_check.parse_budgets("grpo=10")["grpo"] == 10.0
    assert gpu_check.parse_budgets("")["linear"] == gpu_check.DEFAULT_BUDGETS["linear"]
    with pytest.raises(SystemExit, match="phase in env, preflight"):
        gpu_check.parse_budgets("a=1")


def test_default_deadline_fits_a_six_minute_call_with_the_shell_kill_in_between():
    sh = (ROOT / "benchmarks" / "device_check.sh").read_text()
    assert "DEVICE_CHECK_TIMEOUT:-340" in sh
    assert gpu_check.DEFAULT_DEADLINE_S + 30 <= 340 < 360


def test_a_row_refuses_unknown_fields_and_statuses():
    r = common.row("p", "c", time_ms=1.0, note="n")
    assert list(r) == [*common.COLUMNS, "data"] and r["ratio"] is None
    with pytest.raises(ValueError, match="unknown fields"):
        common.row("p", "c", speed=1.0)
    with pytest.raises(ValueError, match="status"):
        common.row("p", "c", "passed")


def test_a_raising_case_is_an_error_row_and_the_next_case_still_runs(tmp_path, capsys):
    report = common.Report(tmp_path, "t")
    r = common.Run(args=None, device=torch.device("cpu"), clock=common.Clock(100, {}), report=report, work=tmp_path)
    r.case("p", "boom", lambda: 1 / 0)
    r.case("p", "fine", lambda: [common.row("p", "fine")])
    assert [x["status"] for x in jsonl(tmp_path)] == ["error", "ok"]
    assert "ZeroDivisionError" in jsonl(tmp_path)[0]["note"]
    assert "| p | boom | error |" in (tmp_path / common.MARKDOWN).read_text()


# --- the preflight case against a fake fp8rl_core.fp8.preflight with the agreed API

@dataclass(frozen=True)
class GemmShape:
    layer: str
    pass_name: str
    m: int
    k: int
    n: int
    block_a: tuple
    block_b: tuple

    def describe(self) -> str:
        return f"{self.layer} {self.pass_name} M={self.m} K={self.k} N={self.n}"


def fake_shapes(hidden: int = 256, ms=(4, 64)) -> list[GemmShape]:
    return [GemmShape(f"layers.0.{name}", p, m, hidden, hidden, (1, 128), (128, 128))
            for m in ms for name in ("q_proj", "down_proj") for p in ("forward", "dgrad", "wgrad")]


def fake_preflight(fail_on: str | None = None):
    mod = types.ModuleType(gemm.PREFLIGHT)
    calls = []

    class PreflightError(RuntimeError):
        """The fake module's own error type, as the real one has."""

    def model_shapes(cfg, ms):
        return fake_shapes(cfg.hidden_size, ms)

    def run_preflight(shapes, device, *, executor=None, compiled=False, seed=0):
        calls.append((len(shapes), str(device), executor, compiled))
        bad = [s for s in shapes if s.layer.endswith(fail_on or "-")]
        if bad:
            raise PreflightError(f"{bad[0].describe()}: error 3.1x the bound")
        ratio = 0.25 * (1 + ("down" in shapes[0].layer) + (shapes[0].pass_name == "wgrad"))  # worst: down wgrad
        return SimpleNamespace(shapes_checked=len(shapes), worst_ratio=ratio, worst_shape=shapes[0],
                               executor="emulated", compiled=compiled, seconds=0.5)

    mod.GemmShape, mod.PreflightError, mod.model_shapes, mod.run_preflight = (GemmShape, PreflightError,
                                                                              model_shapes, run_preflight)
    return mod, calls


def fake_run(tmp_path):
    args = SimpleNamespace(preflight_ms=[4, 64], preflight_compiled_ms=[4, 64], preflight_compiled_max=0, executor=None,
                           compile_backend="aot_eager")
    return common.Run(args=args, device=torch.device("cpu"), clock=common.Clock(100, {}),
                      report=common.Report(None, "t"), work=tmp_path)


def test_preflight_case_checks_every_shape_and_reports_the_worst(monkeypatch, tmp_path):
    mod, calls = fake_preflight()
    monkeypatch.setitem(sys.modules, gemm.PREFLIGHT, mod)
    (r,) = gemm.preflight_rows(fake_run(tmp_path), "preflight eager", compiled=False)
    assert r["status"] == "ok" and r["ratio"] == 0.75 and r["data"]["checked"] == 12
    assert "12 of 12 shapes (M in [4, 64]) within the bound on emulated" in r["note"]
    assert "worst 0.750 of the bound at layers.0.down_proj wgrad M=64" in r["note"]
    assert calls == [(1, "cpu", None, False)] * 12  # one shape per call: the budget can stop it between shapes


def test_preflight_case_fails_naming_the_shape_and_counts_the_failures(monkeypatch, tmp_path):
    mod, _ = fake_preflight(fail_on="down_proj")
    monkeypatch.setitem(sys.modules, gemm.PREFLIGHT, mod)
    (r,) = gemm.preflight_rows(fake_run(tmp_path), "preflight eager", compiled=False)
    assert r["status"] == "fail" and r["data"]["failed"] == 6
    assert "6 of 12 shapes fail the bound; first: layers.0.down_proj forward M=4" in r["note"]


def test_compiled_preflight_uses_the_compile_backend_and_stops_at_the_phase_budget(monkeypatch, tmp_path):
    mod, calls = fake_preflight()
    mod.COMPILE_BACKEND = "inductor"
    seen = []
    original = mod.run_preflight
    mod.run_preflight = lambda *a, **k: (seen.append(mod.COMPILE_BACKEND), original(*a, **k))[1]
    monkeypatch.setitem(sys.modules, gemm.PREFLIGHT, mod)
    run = fake_run(tmp_path)
    now = [0.0]
    run.clock = common.Clock(100, {gemm.PHASE: 20}, now=lambda: now[0])
    run.clock.phase_left(gemm.PHASE)  # the phase starts at t = 0
    mod.model_shapes, shapes = (lambda cfg, ms: shapes), fake_shapes()
    real = mod.run_preflight
    mod.run_preflight = lambda *a, **k: (now.__setitem__(0, now[0] + 4.0), real(*a, **k))[1]  # 4 s a shape
    (r,) = gemm.preflight_rows(run, "preflight compiled", compiled=True)
    assert r["status"] == "ok" and r["data"]["checked"] == 4 and "stopped after 4 of 12 shapes" in r["note"]
    assert seen == ["aot_eager"] * 4 and mod.COMPILE_BACKEND == "inductor"  # restored
    assert all(c[3] is True for c in calls)


def test_preflight_case_skips_when_the_module_is_absent(monkeypatch, tmp_path):
    monkeypatch.setattr(gemm, "installed", lambda name: False)
    (r,) = gemm.preflight_rows(fake_run(tmp_path), "preflight eager", compiled=False)
    assert r["status"] == "skipped" and "not in this tree" in r["note"]
