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
        python3 -m graphsan.cli repro --child 1 --preset small --result "$OUT/trace1.json" \
        > "$OUT/trace1.log" 2>&1; grep -n -m5 -B2 -A25 "Traceback\|device-side assert" "$OUT/trace1.log" | tail -60 ;;
    wide)  # cases 1 and 4 with wider Mamba out_proj workspaces (4 and 8 MiB per half)
      for h in 128 256; do echo "--- mamba heads $h"
        timeout 150 python3 -m graphsan.cli repro --case 1 --case 4 --mamba-heads $h --timeout 140 \
          --json "$OUT/wide$h.json" > "$OUT/wide$h.log" 2>&1; sed -n '/^| case/,/^whole/p' "$OUT/wide$h.log"
      done ;;
    schedules)
      timeout 150 python3 - <<'PY' 2>&1 | tee "$OUT/schedules.log" | grep -v "^W\|^ *warn"
import collections, graphsan
from graphsan.report import one_line
from graphsan.lab.train import TrainConfig, train
def run(**kw):
    base = dict(preset="tiny", quiet=True, device="cuda", train_iters=6, seq_length=64,
                micro_batch_size=1, global_batch_size=4, cuda_graph_warmup_steps=2,
                precision_config="mxfp8-all", capture_grads=())
    base.update(kw)
    return train(TrainConfig(**base))
scopes = ("attn", "mamba", "moe_router", "moe_preprocess", "mlp")
for run_s, cap_s, inflight, gb in [("1f1b", "sequential", 2, 4), ("sequential", "1f1b", 2, 4),
                                   ("1f1b", "sequential", 3, 6), ("1f1b", "sequential", 2, 2)]:
    kw = dict(microbatch_schedule=run_s, microbatches_in_flight=inflight, global_batch_size=gb)
    eager = run(**kw)
    off = run(cuda_graph_modules=scopes, capture_schedule=cap_s, **kw)
    worst = max(abs(a - b) / abs(a) for a, b in zip(eager.losses, off.losses))
    with graphsan.watch(policy="record") as san:
        run(cuda_graph_modules=scopes, capture_schedule=cap_s, **kw)
    kinds = collections.Counter(f.kind for f in san.findings)
    first = san.findings[0] if san.findings else None
    print(f"run {run_s} captured {cap_s} in-flight {inflight} mb {gb}: worst loss rel {worst:.3g}; "
          f"eager {[round(x, 4) for x in eager.losses]} graphed {[round(x, 4) for x in off.losses]}; "
          f"findings {dict(kinds)}; first: {one_line(first) if first else None}")
PY
      ;;
    *) echo "unknown part $part (trace1, wide, schedules)" ;;
  esac
done
