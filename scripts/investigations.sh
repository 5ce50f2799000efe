#!/usr/bin/env bash
# On the GPU machine: one-off investigations of the #3316 matrix, kept because docs/te-3316.md
# cites what they found ("Case 1's symptom"). Logs under $OUT.
#   trace1: case 1 with CUDA_LAUNCH_BLOCKING=1, to name the kernel whose device-side assert fires
#   wide:   cases 1 and 4 with wider Mamba out_proj workspaces (4 and 8 MiB per half)
#   schedules: the lab's step run in another microbatch order than its graphs were captured in,
#           unwatched (losses against eager) and under graphsan record (the kinds found)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/graphsan-out}; mkdir -p "$OUT"
for part in ${*:-trace1}; do
  echo "=== $part ($(date +%T))"
  case $part in
    trace1)  # which kernel trips case 1's device-side assert (launches made synchronous)
      CUDA_LAUNCH_BLOCKING=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 \
        python3 -m graphsan.lab.repro.child 1 --preset small --result "$OUT/trace1.json" \
        > "$OUT/trace1.log" 2>&1; grep -n -m5 -B2 -A25 "Traceback\|device-side assert" "$OUT/trace1.log" | tail -60 ;;
    wide)  # cases 1 and 4 with wider Mamba out_proj workspaces (4 and 8 MiB per half)
      for h in 128 256; do echo "--- mamba heads $h"
        timeout 150 python3 -m graphsan.cli repro --case 1 --case 4 --mamba-heads $h --timeout 140 \
          --json "$OUT/wide$h.json" > "$OUT/wide$h.log" 2>&1; sed -n '/^| case/,/^whole/p' "$OUT/wide$h.log"
      done ;;
    schedules)  # each run in its own process: a stale replay can kill the CUDA context
      for combo in "1f1b sequential 2 4" "sequential 1f1b 2 4" "1f1b sequential 2 2" \
                   "sequential 1f1b 2 2" "1f1b sequential 3 6"; do
        for mode in eager off record; do
          timeout 60 python3 scripts/schedule_run.py $combo $mode > "$OUT/sched.log" 2>&1
          rc=$?; echo "$combo $mode: rc $rc $(grep -m1 '^RESULT' "$OUT/sched.log" || grep -m1 -o 'device-side assert\|illegal memory access' "$OUT/sched.log")"
        done
      done 2>&1 | tee "$OUT/schedules.log" ;;
    *) echo "unknown part $part (trace1, wide, schedules)" ;;
  esac
done
