#!/usr/bin/env bash
# Where a training step's time goes under graphsan (make_graphed_callables, bench_sanitizer):
# a profile of the record variant, then the bench's variants that separate PyTorch's GPU-trace
# dispatch, graphsan's callbacks and the allocation-site walk, with an allocation-heavy optimizer
# (foreach AdamW) and a fused one.
export PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/graphsan-out}; mkdir -p "$OUT"
timeout 90 python3 -m cProfile -o "$OUT/replay.prof" bench/bench_sanitizer.py --child record \
  --layers 8 --steps 30 --rounds 1 --warmup 3 2>&1 | grep -E "^(RESULT|FINDING)" | cut -c1-300
python3 - <<'PY'
import os, pstats
p = pstats.Stats(os.path.join(os.environ.get("OUT", "/tmp/graphsan-out"), "replay.prof"))
p.sort_stats("tottime").print_stats(15)
PY
timeout 300 python3 bench/bench_sanitizer.py --layers 32 --steps 30 --rounds 3 --repeats 2 \
  --optimizer foreach 2>&1 | grep -E "^(\||# )"
timeout 180 python3 bench/bench_sanitizer.py --layers 32 --steps 30 --rounds 3 --repeats 2 \
  --optimizer fused --variants trace,record,record-nostacks,record-compiled 2>&1 | grep -E "^(\||# )"
