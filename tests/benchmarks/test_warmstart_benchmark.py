"""benchmarks/warmstart.py: the warm start's step on this CPU's BF16 path and the FP32 floor, split into the
profiler's parts, against the standalone GEMMs of the same step, and its projection. No test depends on the
machine's speed or CPU kind: the rows, labels and the arithmetic between them are checked, not the times."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl_core.model.bf16 import resolve_bf16_compute

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "warmstart.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_warmstart", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def sections(text: str) -> dict[str, dict[str, list[str]]]:
    """The table by path: the `warm-start step [...]` row's label -> {case: [ms, ratio, note]} of its rows."""
    out: dict[str, dict[str, list[str]]] = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| case"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0].startswith("warm-start step "):
                section = out.setdefault(cells[0].removeprefix("warm-start step "), {})
            section[cells[0]] = cells[1:]
    return out


def test_rows_of_the_auto_path_and_the_fp32_floor(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(SCRIPT), "--steps", "2", "--warmup", "1",
                          "--target-steps", "40", "--threads", "1", "--cache-dir", str(tmp_path),
                          "--set", "warmstart.dev_size=4", "--set", "warmstart.batch_size=8",
                          "--set", "warmstart.eval_every=20"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    path = resolve_bf16_compute("auto", "cpu")
    assert f"model.bf16_compute auto -> {path}" in out.stdout
    table = sections(out.stdout)
    assert list(table) == [f"[auto: {path}]", "[fp32]"]
    for label, section in table.items():
        step = float(section[f"warm-start step {label}"][0])
        assert section[f"warm-start step {label}"][1] == "1.00" and "batch 8" in section[f"warm-start step {label}"][2]
        parts = {k.strip(): v for k, v in section.items() if k.endswith("(profiler share)")}
        assert list(parts) == [f"{p} (profiler share)" for p in ("GEMMs", "attention", "optimizer", "rest")]
        assert sum(float(v[1]) for v in parts.values()) == pytest.approx(1.0, abs=0.02)  # printed to 2 places
        floor = next(v for k, v in section.items() if k.startswith("GEMM floor"))
        assert float(floor[0]) > 0 and float(floor[1]) == pytest.approx(step / float(floor[0]), rel=0.02, abs=0.01)
        # the projection: 40 steps x (step + batch) + 40 // 20 dev checks, in ms as printed
        batch = float(section["building the batch"][0])
        check = float(section[f"dev check {label} (4 prompts, greedy)"][0])
        projected = section[f"projected warm start {label}: 40 steps"]
        assert "--target-steps" in projected[2]
        assert float(projected[0]) == pytest.approx(40 * (step + batch) + 2 * check, rel=2e-3, abs=0.5)


def test_profiler_shares_sum_to_one():
    bench = load_bench()

    class Event:
        def __init__(self, key, self_us, total_us=0.0):
            self.key, self.self_cpu_time_total, self.cpu_time_total = key, self_us, total_us

    events = [Event("aten::mm", 60.0), Event("aten::addmm", 10.0),
              Event("aten::_scaled_dot_product_flash_attention_for_cpu", 5.0),
              Event("Optimizer.step#AdamW.step", 1.0, 8.0), Event("aten::_foreach_norm", 2.0), Event("aten::mul", 14.0)]
    got = bench.shares(events)
    assert got["GEMMs"] == pytest.approx(70 / 92) and got["attention"] == pytest.approx(5 / 92)
    assert got["optimizer"] == pytest.approx(10 / 92)  # AdamW's total + the clip's norms
    assert sum(got.values()) == pytest.approx(1.0)


def test_a_path_that_does_not_exist_is_refused():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(SCRIPT), "--paths", "auto,fp16"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 2 and "--paths: 'fp16' is not a path; valid: emulated, native, fp32, auto" in out.stderr


def test_the_projection_reads_the_steps_of_the_cached_warm_start(tmp_path):
    """The steps come from warmstart.txt of this config's cache entry (as warm_start writes it), else None."""
    from fp8rl_core.loop.warmstart import warmstart_key

    bench = load_bench()
    setup = bench.setup_for("auto", [f"warmstart.cache_dir={tmp_path}"])
    assert bench.cached_steps(setup) is None
    entry = tmp_path / warmstart_key(setup.cfg)
    entry.mkdir()
    (entry / "warmstart.txt").write_text("steps=2500 final_loss=0.04108 dev_accuracy=0.9062\n")
    assert bench.cached_steps(setup) == 2500
    assert bench.cached_steps(bench.setup_for("fp32", [f"warmstart.cache_dir={tmp_path}"])) is None  # another key
