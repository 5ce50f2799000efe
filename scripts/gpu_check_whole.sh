#!/usr/bin/env bash
# The whole GPU check in one device call, its parts side by side on one GPU (16 cores):
#   every GPU test through the class wrapper and through torch 2.14's hooks (GPU_WORKERS each),
#   `graphsan selftest` through both, and the #3316 matrix twice (`graphsan repro`);
#   with PEER_DIR set (a folder holding PyTorch's graph tests and their run.sh), those tests
#   under `pytest --graphsan` too.
# Run from the project root:  OUT=$OUT bash scripts/gpu_check_whole.sh
# Every log goes into one file, $OUT/gpu-check.tgz (rewritten every 20 s, so a call cut off
# at its limit still brings back what ran), and the closing lines of each part into
# $OUT/summary.txt: a device call brings back a few files only. Knobs: WHOLE_LIMIT (seconds for
# the parts, 420), GPU_WORKERS (3 per attachment), SELFTEST_JOBS (3).
set -u
ROOT=$PWD
if [ ! -d src/graphsan ] || [ ! -f scripts/gpu_check.sh ]; then
  echo "gpu_check_whole.sh: run it from the project root (no src/graphsan in $PWD)" >&2
  exit 2
fi
LIMIT=${WHOLE_LIMIT:-420}
for knob in WHOLE_LIMIT GPU_WORKERS SELFTEST_JOBS; do
  value=${!knob:-1}
  if ! [[ $value =~ ^[1-9][0-9]*$ ]]; then
    echo "gpu_check_whole.sh: $knob=$value: expected a positive whole number" >&2
    exit 2
  fi
done
if [ -n "${PEER_DIR:-}" ] && [ ! -f "$PEER_DIR/run.sh" ]; then
  echo "gpu_check_whole.sh: PEER_DIR=$PEER_DIR: expected a folder holding run.sh" >&2
  exit 2
fi
FINAL=${OUT:-/tmp/graphsan-out}
WORK=$(mktemp -d)/gpu-check
mkdir -p "$FINAL" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
T0=$(date +%s)
since() { echo "$1 $(( $(date +%s) - T0 ))s" >> "$WORK/times.txt"; }

pack() { tar czf "$FINAL/gpu-check.tgz.part" -C "$(dirname "$WORK")" gpu-check 2>/dev/null \
           && mv "$FINAL/gpu-check.tgz.part" "$FINAL/gpu-check.tgz"; }
( while true; do sleep 20; pack; done ) & PACKER=$!

{ nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  git -C "$ROOT" log --oneline -1; } > "$WORK/machine.txt" 2>&1
# the compiled tracker, built once before the parts start (parts building it at once would
# each run on snapshots meanwhile, and tests that need the tracker would fail)
timeout 180 python3 -m graphsan.cuda.tracelog > "$WORK/tracelog.log" 2>&1
since "tracker built (rc $?)"
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }

lanes=()
for hooks in "" 1; do
  ( tag=${hooks:+hooks}; tag=${tag:-wrapper}
    GRAPHSAN_TEST_TORCH_HOOKS=$hooks GPU_WORKERS=${GPU_WORKERS:-3} TESTS_LIMIT=$(( $(left) - 20 )) \
      OUT="$WORK/$tag" bash scripts/gpu_check.sh tests-parallel > "$WORK/$tag.log" 2>&1
    since "tests through the $tag" ) &
  lanes+=($!)
done
( for hooks in "" 1; do
    tag=${hooks:+hooks}; tag=${tag:-wrapper}
    extra=${hooks:+$ROOT/tests/torch_hooks_site:}
    secs=$(left); [ -n "$hooks" ] || secs=$(( secs / 2 ))  # the wrapper's run leaves half
    PYTHONPATH="$extra$PYTHONPATH" timeout "$secs" python3 -m graphsan.cli selftest \
      --jobs "${SELFTEST_JOBS:-3}" --json "$WORK/selftest-$tag.json" > "$WORK/selftest-$tag.log" 2>&1
    since "selftest through the $tag"
  done ) &
lanes+=($!)
( for n in 1 2; do
    [ "$(left)" -gt 120 ] || break
    timeout "$(left)" python3 -m graphsan.cli repro --timeout 240 --json "$WORK/repro-$n.json" \
      > "$WORK/repro-$n.log" 2>&1
    since "repro $n"
  done ) &
lanes+=($!)
if [ -n "${PEER_DIR:-}" ] && [ -f "$PEER_DIR/run.sh" ]; then
  ( PEER_ONLY=graphsan PEER_BUDGET_S=$(( $(left) - 30 )) OUT="$WORK/peer" timeout "$(left)" \
      bash "$PEER_DIR/run.sh" > "$WORK/peer.log" 2>&1
    since "PyTorch's graph tests" ) &
  lanes+=($!)
fi
wait "${lanes[@]}"
kill "$PACKER" 2>/dev/null
since "all"
{ cat "$WORK/machine.txt" "$WORK/times.txt"
  for tag in wrapper hooks; do
    echo "--- GPU tests through the $tag"
    grep -hE "^(FAILED|ERROR) |[0-9]+ (passed|failed|skipped|errors?) " "$WORK/$tag"/tests-*.log 2>/dev/null | tail -30
    echo "--- selftest through the $tag"; tail -n 6 "$WORK/selftest-$tag.log" 2>/dev/null
  done
  for n in 1 2; do echo "--- repro $n"; grep -E "^graphsan repro|^\| [0-9]+ \|" "$WORK/repro-$n.log" 2>/dev/null | cut -c1-160; done
  [ -f "$WORK/peer.log" ] && { echo "--- PyTorch's graph tests"; grep "^PEER" "$WORK/peer.log"; }
} > "$WORK/summary.txt" 2>&1
cp "$WORK/summary.txt" "$FINAL/summary.txt"
pack
cat "$FINAL/summary.txt"
