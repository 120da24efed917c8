#!/usr/bin/env bash
# The checks only a CUDA device can run, in one call (under 6 minutes on one GPU): tests/gpu, a smoke run
# (a real OOM report memory_viz opens, a leak found on CUDA, the exporter's device series), then the
# agent's cost on GPU steps (bench_step_overhead.py --cuda, with and without a tracked leak,
# bench_gpu_overhead.py, bench_attach.py).
# Each smoke check runs in a fresh process.
#
#   bash benchmarks/gpu_check.sh [--logs DIR] [--record DIR]
#
# --logs DIR (or GPUMEMD_CHECK_LOGS; default $OUT when set, as on the lent device machine, else
#   ./gpu-check-logs): the whole pytest log, its JUnit XML, each smoke run's output and the overhead
#   table are written there, so a remote run brings them back.
# --record DIR: also record real CUDA data for the CPU tests (benchmarks/gpu_record.py); commit the
#   files under tests/data/cuda/.
# Prints a summary (each failing test with its assertion line) and exits non-zero on any failure.
# Without a CUDA device it says so and exits 0 (nothing was checked).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
LOGS="${GPUMEMD_CHECK_LOGS:-${OUT:-gpu-check-logs}}"
RECORD=""
while [ $# -gt 0 ]; do
    case "$1" in
        --logs) LOGS="$2"; shift 2 ;;
        --record) RECORD="$2"; shift 2 ;;
        *) echo "gpu_check: unknown argument '$1' (use --logs DIR, --record DIR)" >&2; exit 2 ;;
    esac
done
mkdir -p "$LOGS"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: SKIPPED - no CUDA device here (torch.cuda.is_available() is False); nothing was checked."
    echo "gpu_check: run it on a machine with a GPU: benchmarks/gpu_check.sh"
    exit 0
fi
"$PY" -c 'import torch; print("gpu_check: torch", torch.__version__, "on", torch.cuda.get_device_name(0))' \
    | tee "$LOGS/device.txt"

declare -a NAMES RESULTS
record() { NAMES+=("$1"); RESULTS+=("$2"); }
start=$(date +%s)

if [ -n "$RECORD" ]; then
    timeout 150 "$PY" benchmarks/gpu_record.py "$RECORD" 2>&1 | tee "$LOGS/record.log"
    rc=${PIPESTATUS[0]}
    record "record" "$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)"
fi

# One process (-n 0): the workers of the suite's default would share the device and its readings.
# The whole log is kept; the summary below names each failure with its assertion line.
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -n 0 -rfE --junitxml="$LOGS/tests-gpu.xml" tests/gpu \
    > "$LOGS/tests-gpu.log" 2>&1
rc=$?
tail -3 "$LOGS/tests-gpu.log"
record "tests/gpu" "$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)"

for smoke in oom leak exporter; do
    limit=40; [ "$smoke" = leak ] && limit=100
    timeout "$limit" "$PY" benchmarks/gpu_smoke.py "$smoke" > "$LOGS/smoke-$smoke.log" 2>&1
    rc=$?
    grep '^SMOKE' "$LOGS/smoke-$smoke.log" || tail -5 "$LOGS/smoke-$smoke.log"
    record "smoke: $smoke" "$([ "$rc" -eq 0 ] && echo PASS || echo FAIL)"
done

# The agent's cost, two ways. In one process (bench_step_overhead.py --cuda): blocks of steps with the
# agent on and off in random order, each step synchronized, so the estimate is tight (a fresh process
# moves a GPU job's step time by several percent). In fresh processes (bench_gpu_overhead.py): what a
# user's A/B sees, the launch-bound MLP only. Then attach()'s own cost.
rc=0
{ timeout 120 "$PY" benchmarks/bench_step_overhead.py --cuda mlp transformer --seconds 20 || rc=1
  # The same launch-bound MLP while a 1-tensor/step CUDA leak is tracked (the hardening issue's cost).
  timeout 60 "$PY" benchmarks/bench_step_overhead.py --cuda mlp --leak --seconds 15 || rc=1
  GPUMEMD_BENCH_PROFILE="$LOGS" timeout 100 "$PY" benchmarks/bench_gpu_overhead.py --jobs mlp --pairs 2 \
      --steps 1500 --warmup 400 || rc=1
  timeout 60 "$PY" benchmarks/bench_attach.py --repeats 20 --fresh 3 || rc=1
} > "$LOGS/overhead.md" 2>&1
cat "$LOGS/overhead.md"
record "overhead bench" "$([ "$rc" -eq 0 ] && echo RAN || echo FAIL)"

echo
echo "gpu_check summary ($(( $(date +%s) - start )) s; logs in $LOGS):"
failed=0
for i in "${!NAMES[@]}"; do
    printf '  %-20s %s\n' "${NAMES[$i]}" "${RESULTS[$i]}"
    case "${RESULTS[$i]}" in PASS|RAN) ;; *) failed=1 ;; esac
done
# Each failing test and the line of its assertion, from the JUnit XML pytest wrote.
"$PY" - "$LOGS/tests-gpu.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"  (no JUnit XML: {exc})")
    sys.exit(0)
for case in root.iter("testcase"):
    for bad in list(case.findall("failure")) + list(case.findall("error")):
        where = [ln for ln in (bad.text or "").splitlines() if ln.startswith(("E ", ">"))][:3]
        print(f"  FAILED {case.get('classname')}::{case.get('name')}")
        print("    " + (bad.get("message") or "").splitlines()[0][:300] if bad.get("message") else "")
        for ln in where:
            print("    " + ln[:300])
EOF
if [ "$failed" -eq 0 ]; then echo "gpu_check: PASS"; else echo "gpu_check: FAIL"; fi
exit "$failed"
