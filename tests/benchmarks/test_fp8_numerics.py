"""benchmarks/fp8_numerics.py runs in seconds at tiny sizes: issue 25's CPU path rows (FP32 quantize +
dequantize vs a copy, Fp8Linear vs BF16 nn.Linear) with the flags that chose each path, and the older rows."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from fp8rl_core.fp8 import cpu_features, fused_cpu, select_executor

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fp8_numerics.py"
TINY = ("--quick", "--repeats", "1", "--tokens", "128", "--sizes", "128")


def run(*args: str, **env: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", **env}  # the CPU rows, even on a GPU box
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def row(text: str, case: str) -> list[str]:
    """The cells of the table row whose case starts with `case`."""
    lines = [ln for ln in text.splitlines() if ln.startswith(f"| {case}")]
    assert lines, f"no row {case!r} in:\n{text}"
    return [cell.strip() for cell in lines[0].strip("|").split("|")]


def test_cpu_path_rows_name_their_paths_and_goals():
    text = run(*TINY, "--only", "cpu-paths")
    path = fused_cpu.simd_path()
    assert f"# cpu kernel flags: {cpu_features.kernel_flags()}; fused quantizer path: {path}; " in text
    assert f"GEMM executor (cpu): {select_executor('cpu')}" in text
    both = row(text, "quantize + dequantize (1, 128) fp32 1024x1024")
    assert float(both[3]) > 0 and both[4] == {"avx512": ">= 0.50", "avx2": "~0.29"}.get(path, "")
    assert both[5].startswith(f"path {path}")
    for case in ("copy fp32 1024x1024", "quantize + dequantize (128, 128)", "quantize (1, 128) fp32 1024x1024 -> fp32",
                 "floor: a fresh fp32 1024x1024 output"):
        row(text, case)
    if any(cpu_features.has(f) for f in ("avx512_bf16", "amx_bf16")):
        for threads in sorted({1, int(text.split(" threads)")[0].rsplit("(", 1)[1])}):
            selected = row(text, f"Fp8Linear [{select_executor('cpu')}] fwd+bwd M=128 K=N=128 {threads}T")
            assert selected[4] == "<= 1.00" and float(selected[3]) > 0
            row(text, f"Fp8Linear [emulated] fwd+bwd M=128 K=N=128 {threads}T")
            row(text, f"nn.Linear bf16 fwd+bwd M=128 K=N=128 {threads}T")
    else:
        assert "rows skipped: no avx512_bf16 or amx_bf16" in text
    # issue 35: every CPU executor here measured, the selected one (the tests' runs: the default) marked
    selected = select_executor("cpu")
    assert f"# FP8 GEMM executor selected as a run here would: {selected} (default: not measured" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("# executor calibration: CPU "))
    assert f"kernel flags {cpu_features.kernel_flags()};" in line and f"selected {selected} (margin 15%)" in line
    for name in ("emulated", "emulated_blockwise"):
        for case in (f"executor [{name}] calibration (calibrate.SHAPES)", f"executor [{name}] fwd+bwd M=128 K=N=128"):
            cells = row(text, case)
            assert cells[5].startswith("selected") == (name == selected) and float(cells[1]) > 0


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or not cpu_features.has("avx2"),
                    reason="needs avx2 (the path the hidden flags step down to)")
def test_hidden_flags_step_the_rows_down():
    text = run(*TINY, "--only", "cpu-paths", FP8RL_CPU_FLAGS_OFF="avx512f avx512_bf16 amx_bf16")
    assert "fused quantizer path: avx2" in text and "avx512f" not in text.splitlines()[1]
    assert row(text, "quantize + dequantize (1, 128) fp32 1024x1024")[4] == "~0.29"
    assert "rows skipped: no avx512_bf16 or amx_bf16" in text


def test_the_older_rows_still_run():
    text = run(*TINY)
    for case in ("copy bf16 1024x1024", "quant+dequant (1, 128) [fused]", "nn.Linear fp32 fwd+bwd M=128 K=N=128",
                 "quantize + dequantize (1, 128) fp32 1024x1024"):
        row(text, case)
