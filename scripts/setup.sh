#!/usr/bin/env bash
# Create ./.venv and install fp8rl into it, from nothing but Python 3.11.
#   bash scripts/setup.sh            # runtime + dev (tests) dependencies
#   EXTRAS=dev,bench bash scripts/setup.sh
# torch is installed first and pinned, so that no later requirement can pull another (CUDA) build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${EXTRAS:-dev}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
pip_q --upgrade pip
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  pip_q "torch==$TORCH_VERSION"
fi
pip_q -e ".[${EXTRAS}]" "torch==$TORCH_VERSION"
python -c "import torch; print(f'fp8rl: .venv ready (torch {torch.__version__})')"
