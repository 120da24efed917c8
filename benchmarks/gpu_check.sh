#!/usr/bin/env bash
# The checks only a CUDA device can run, in one call (under 8 minutes): tests/gpu, then a smoke run
# (a real OOM report memory_viz opens, a leak found on CUDA, the exporter's device series). Each
# smoke check runs in a fresh process. Prints a PASS/FAIL summary; exit 0 only if everything passed.
# Without a CUDA device it says so and exits 0 (nothing was checked).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: SKIPPED - no CUDA device here (torch.cuda.is_available() is False); nothing was checked."
    echo "gpu_check: run it on a machine with a GPU: benchmarks/gpu_check.sh"
    exit 0
fi
"$PY" -c 'import torch; print("gpu_check: torch", torch.__version__, "on", torch.cuda.get_device_name(0))'

declare -a NAMES RESULTS
record() { NAMES+=("$1"); RESULTS+=("$2"); }
start=$(date +%s)

# one process (-n 0): the workers of the suite's default would share the device and its readings
timeout 270 "$PY" -m pytest -q -p no:cacheprovider -n 0 tests/gpu 2>&1 | tail -25
rc=${PIPESTATUS[0]}
record "tests/gpu" "$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)"

for smoke in oom leak exporter; do
    limit=40; [ "$smoke" = leak ] && limit=100
    timeout "$limit" "$PY" benchmarks/gpu_smoke.py "$smoke"
    rc=$?
    record "smoke: $smoke" "$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)"
done

echo
echo "gpu_check summary ($(( $(date +%s) - start )) s):"
failed=0
for i in "${!NAMES[@]}"; do
    printf '  %-20s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"
    [ "${RESULTS[$i]}" = PASS ] || failed=1
done
if [ "$failed" -eq 0 ]; then echo "gpu_check: PASS"; else echo "gpu_check: FAIL"; fi
exit "$failed"
