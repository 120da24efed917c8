#!/usr/bin/env bash
# Write a file_sd target file for one torchrun job: one target per local rank on every node.
# Usage: write_targets.sh JOB_NAME BASE_PORT NPROC_PER_NODE NODE [NODE...] > file_sd/JOB_NAME.json
# (write to a temp file and mv it into place: Prometheus may read a half-written file otherwise).
set -euo pipefail
job="$1"; port="$2"; nproc="$3"; shift 3
printf '['
first=1
for node in "$@"; do
  targets=""
  for ((r = 0; r < nproc; r++)); do
    targets+="${targets:+, }\"${node}:$((port + r))\""
  done
  [ "$first" = 1 ] || printf ','
  first=0
  printf '\n  {"targets": [%s], "labels": {"training_job": "%s", "node": "%s"}}' "$targets" "$job" "$node"
done
printf '\n]\n'
