#!/usr/bin/env bash
# Set up and run the main job on this machine (the README's first command):
#   bash scripts/quickstart.sh [sweep overrides...]     e.g. bash scripts/quickstart.sh max_parallel=1
# Local executor, embedded MLflow store (sqlite:///mlflow.db in this folder); the figures, the table
# and the claim checks land under outputs/fp8_ablation/report and in the sweep's MLflow parent run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
# One thread per process (cells set `threads: 1` too). The warm start runs alone and would take both
# cores, but on a shared 2-core machine a 2-thread warm start slows ~5x as soon as another process holds a
# core (measured: 1.21 s/step at 2 threads vs 0.22 s/step at 1 thread, side by side under the same load).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# BF16 is native where the CPU has BF16 dot products (AVX512_BF16 / AMX), emulated exactly elsewhere
# and the FP8 GEMM runs on AMX tiles where the CPU has them (cpu_bf16dot), on the FP32 emulation elsewhere
fp8rl-train --print-config | sed -n 's/^# \(BF16 path: .*\|FP8 GEMM: .*\)/\1/p'
sweep run sweeps/fp8_ablation.yaml "$@"
echo
echo "See the runs in the MLflow UI:  .venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1"
# the report's link opens the runs table ("Model training"), not MLflow 3's GenAI overview
link=$(sed -n 's/^In the MLflow UI: //p' outputs/fp8_ablation/report/report.md 2>/dev/null || true)
if [ -n "$link" ]; then echo "then open $link"; fi
