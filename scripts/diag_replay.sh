#!/usr/bin/env bash
# Where a training step's time goes under graphsan (make_graphed_callables, bench_sanitizer):
# a profile of the record variant, then the bench with and without allocation stacks.
export PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/graphsan-out}; mkdir -p "$OUT"
timeout 90 python3 -m cProfile -o "$OUT/replay.prof" bench/bench_sanitizer.py --child record \
  --layers 8 --steps 30 --rounds 1 --warmup 3 2>&1 | grep -E "^(RESULT|FINDING)" | cut -c1-300
python3 - <<'PY'
import os, pstats
p = pstats.Stats(os.path.join(os.environ.get("OUT", "/tmp/graphsan-out"), "replay.prof"))
p.sort_stats("tottime").print_stats(20)
PY
for flag in "" --no-alloc-stacks; do
  timeout 200 python3 bench/bench_sanitizer.py --layers 32 --steps 50 --rounds 3 --repeats 2 $flag \
    2>&1 | grep -E "^\| (variant|off|record|raise)"
done
