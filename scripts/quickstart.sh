#!/usr/bin/env bash
# Set up and run the main job on this machine (the README's first command):
#   bash scripts/quickstart.sh [sweep overrides...]     e.g. bash scripts/quickstart.sh max_parallel=1
# Local executor, embedded MLflow store (sqlite:///mlflow.db in this folder); the figures, the table
# and the claim checks land under outputs/fp8_ablation/report and in the sweep's MLflow parent run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
sweep run sweeps/fp8_ablation.yaml "$@"
echo
echo "See the runs in the MLflow UI:  .venv/bin/mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1"
