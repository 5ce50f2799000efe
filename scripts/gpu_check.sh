#!/usr/bin/env bash
# One call on the GPU machine: the parts named as arguments (default: all), logs under $OUT.
#   tests     pytest -m gpu (every GPU test)         repro   graphsan repro (the matrix)
#   example   graphsan run examples/stale_input.py   bench   bench/bench_sanitizer.py
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/graphsan-out}; mkdir -p "$OUT"
parts=${*:-tests example repro bench}
for part in $parts; do
  echo "=== $part ($(date +%T))"
  case $part in
    tests) python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -25 ;;
    example)
      python3 examples/stale_input.py > "$OUT/example_off.log" 2>&1; echo "without graphsan: exit $?"
      grep -m1 -o "an illegal memory access[^.]*" "$OUT/example_off.log"
      python3 -m graphsan.cli run examples/stale_input.py > "$OUT/example.log" 2>&1; echo "with graphsan: exit $?"
      sed -n '/^graphsan.report.StaleMemoryError/,$p' "$OUT/example.log" ;;
    repro) python3 -m graphsan.cli repro --json "$OUT/repro.json" 2>&1 | tee "$OUT/repro.log" | tail -60 ;;
    repro-quick) python3 -m graphsan.cli repro --case 1 --case 4 --case 7 2>&1 | tee "$OUT/repro.log" | tail -60 ;;
    bench) python3 bench/bench_sanitizer.py 2>&1 | tee "$OUT/bench_sanitizer.log" | tail -12 ;;
    *) python3 $part 2>&1 | tee "$OUT/$(basename $part).log" | tail -30 ;;
  esac
done
