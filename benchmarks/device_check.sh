#!/usr/bin/env bash
# The one prepared device check (issue 22): every phase of benchmarks/gpu_check.py, rows appended as they finish.
#   bash benchmarks/device_check.sh [--cpu] OUT_DIR [gpu_check.py options...]
# Writes OUT_DIR/device_check.jsonl (a JSON object per row), OUT_DIR/device_check.md (the table),
# OUT_DIR/device_check.log (stdout + stderr) and OUT_DIR/device_check.current (the case last started). On the lent GPU machine, one `run` call (benchmarks/README.md):
#   bash benchmarks/device_check.sh "$OUT"
# --cpu: the CPU smoke of the same phases (tiny sizes, gloo, emulated FP8; CUDA hidden), what CI runs.
# Wheels in .whl/ (carried; e.g. megatron-core for the megatron phase) are installed into a private folder
# first. The check is killed at DEVICE_CHECK_TIMEOUT seconds from this script's start (default 340: inside
# a 6-minute call); the rows written by then stay, and a last row says it was killed. A check that dies
# (a segfault or abort in a kernel) is restarted with --resume: an error row for the phase it died in,
# then the phases after it, in the time left. PYTHON picks the interpreter (default
# python3; here, the project's .venv/bin/python when python3 has no torch).
set -uo pipefail
cd "$(dirname "$0")/.."
cpu=()
if [ "${1:-}" = "--cpu" ]; then cpu=(--cpu); shift; fi
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  echo "usage: bash benchmarks/device_check.sh [--cpu] OUT_DIR [gpu_check.py options...]" >&2
  exit 2
fi
out=$1; shift
mkdir -p "$out" || exit 2
py=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && ! "$py" -c "import torch" 2>/dev/null && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
if compgen -G ".whl/*.whl" >/dev/null; then
  site=${TMPDIR:-/tmp}/fp8rl-device-site
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl ||
    { echo "device_check: installing .whl/*.whl failed" >&2; exit 2; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ ${#cpu[@]} -gt 0 ]; then export CUDA_VISIBLE_DEVICES=""; fi
limit=${DEVICE_CHECK_TIMEOUT:-340}
: >"$out/device_check.log"
rm -f "$out/device_check.current"
resume=()
for attempt in 1 2 3 4; do
  left=$((limit - SECONDS))
  timeout -k 10 "$left" "$py" benchmarks/gpu_check.py ${cpu[@]+"${cpu[@]}"} --out-dir "$out" "$@" \
    ${resume[@]+"${resume[@]}"} 2>&1 |
    tee -a "$out/device_check.log"
  rc=${PIPESTATUS[0]}
  # a crash (a signal: 134 abort, 139 segfault, ...; not timeout's 124/137) with time left: go on after it
  left=$((limit - SECONDS))
  if [ "$rc" -le 128 ] || [ "$rc" = 137 ] || [ "$attempt" = 4 ] || [ "$left" -lt 30 ]; then break; fi
  echo "device_check: the check died (exit $rc); going on with the next phase ($left s left)" >&2
  resume=(--resume "$rc" --deadline $((left - 40)))
done
if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
  during=$(cat "$out/device_check.current" 2>/dev/null | tr -d '"\\|')
  note="killed at ${limit} s (DEVICE_CHECK_TIMEOUT) during ${during:-start-up}: the rows above are what finished"
  printf '{"phase": "end", "case": "killed", "status": "error", "time_ms": null, "ratio": null, "tflops": null, %s}\n' \
    "\"max_rel_diff\": null, \"tmpe\": null, \"peak_gib\": null, \"plan_gib\": null, \"note\": \"$note\", \"data\": {}" \
    >>"$out/device_check.jsonl"
  printf '| end | killed | error | | | | | | | | %s |\n' "$note" >>"$out/device_check.md"
  echo "device_check: $note" >&2
fi
exit "$rc"
