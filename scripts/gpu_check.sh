#!/usr/bin/env bash
# On the GPU machine: the recurring checks named as arguments, each under its own time limit so
# one slow part cannot eat a whole call; logs under $OUT. A device call runs at most 10 minutes.
# The whole check at once, its parts side by side in one call, logs packed into one file:
#   OUT=$OUT bash scripts/gpu_check_whole.sh      (PEER_DIR=... adds PyTorch's graph tests)
# What a change to the sanitizer or the lab needs, in two calls:
#   call 1:  GPU_WORKERS=12 bash scripts/gpu_check.sh tests-parallel repro
#            (every GPU test in 12 workers, the `slow` ones first, within TESTS_LIMIT, 480 s
#            by default; the #3316 matrix, ~40 s)
#   call 2:  bash scripts/gpu_check.sh faults bench      (1,000 fault-injection trials, <= 8 min;
#            the replay-overhead bench, ~1 min)
# Other parts: tests (every GPU test in one process, ~8 min), or its halves sanitizer-tests
# (~1.5 min) and lab-tests (~6.5 min); faults-snapshot (the faults with GRAPHSAN_TRACELOG=0);
# example, scale; faults-baked (the mode, baked-value and superseded faults and controls);
# samples (scripts/make_samples.py, with the new samples and docs copied under $OUT/samples)
#   (selftest: `graphsan selftest` with its JSON and each program's argument bytes under $OUT)
#   (tracker: the compiled allocator tracker's GPU tests; overhead: a profile of a graphed training
#   step under graphsan and the bench without allocation stacks; ranks: the distributed lab on two GPUs)
#   (quant: the Triton kernel tests and bench_quant; quantlinear: bench_quant_linear; train: bench_train; sweep: the kernels'
#   launch parameters; rht: the RHT rows' tiles and Nsight Compute on them; scale: capture cost against live blocks, bench_capture_scale;
#   capture-profile: a cProfile of one process of its scale run)
# One-off investigations (case 1 with synchronous launches, wider Mamba workspaces) are in
# scripts/investigations.sh.
# GRAPHSAN_TEST_TORCH_HOOKS=1 runs every part through torch 2.14.1's graph hooks, laid over this
# torch's CUDAGraph in every Python process (tests/torch_hooks.py); unset, graphsan wraps the
# class, as it does on torch 2.8 to 2.13. A change to how graphsan attaches runs both:
#   bash scripts/gpu_check.sh tests-parallel selftest
#   GRAPHSAN_TEST_TORCH_HOOKS=1 bash scripts/gpu_check.sh tests-parallel selftest
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
if [ "${GRAPHSAN_TEST_TORCH_HOOKS:-}" = 1 ]; then
  export PYTHONPATH="$PWD/tests/torch_hooks_site:$PYTHONPATH"
  python3 -c 'from graphsan.cuda.hooks import Seams; print("graphsan attaches through:", Seams.detect().names())'
fi
OUT=${OUT:-/tmp/graphsan-out}; mkdir -p "$OUT"
TAG=${GRAPHSAN_TEST_TORCH_HOOKS:+-hooks}  # the logs of a run through the hooks keep apart
# graphsan's default, the compiled tracker, into this fresh machine's cache before any part runs
# (a cold cache would leave the first runs on snapshots while a background process compiles it)
[ "${GRAPHSAN_TRACELOG:-}" = 0 ] || timeout 120 python3 -m graphsan.cuda.tracelog
for part in ${*:-tests}; do
  echo "=== $part ($(date +%T))"
  case $part in
    tests)
      timeout 580 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -30 ;;
    tests-parallel)  # every GPU test in 6 workers (pytest-xdist, in the GPU image); a failure is
      # run again alone, so that a test that only fails beside others shows as such
      # (-v names each test as it ends, so a run cut short by its limit still says what failed)
      timeout "${TESTS_LIMIT:-480}" python3 -m pytest -v -m gpu tests -n "${GPU_WORKERS:-6}" -rfE \
        --durations=15 --junitxml="$OUT/gpu-tests$TAG.xml" 2>&1 | tee "$OUT/tests-parallel$TAG.log" | tail -40
      if grep -qE "[0-9]+ (failed|error)" "$OUT/tests-parallel$TAG.log"; then
        timeout 240 python3 -m pytest -q -m gpu tests --lf --lfnf=none -rfE 2>&1 | tee "$OUT/tests-rerun$TAG.log" | tail -15
      fi ;;
    sanitizer-tests)
      timeout 300 python3 -m pytest -q -m gpu tests --ignore=tests/lab -p no:cacheprovider \
        -n "${GPU_WORKERS:-1}" 2>&1 | tee "$OUT/sanitizer-tests$TAG.log" | tail -15 ;;
    lab-tests)
      timeout 540 python3 -m pytest -q -m gpu tests/lab -p no:cacheprovider 2>&1 \
        | tee "$OUT/lab-tests.log" | tail -15 ;;
    selftest)  # the corpus of correct programs and their broken twins (docs/coverage.md)
      mkdir -p /tmp/selftest-dump
      timeout 300 python3 -m graphsan.cli selftest --jobs 12 --dump /tmp/selftest-dump \
        --json "$OUT/selftest$TAG.json" 2>&1 | tee "$OUT/selftest$TAG.log" | tail -40
      tar czf "$OUT/selftest-dump$TAG.tar.gz" -C /tmp selftest-dump ;;
    faults)  # docs/coverage.md (FAULTS_SEED picks the trials)
      timeout 540 python3 bench/bench_faults.py --trials 1000 --workers 16 --time-limit 450 \
        --seed "${FAULTS_SEED:-0}" --json "$OUT/faults.json" 2>&1 | tee "$OUT/faults.log" | tail -40 ;;
    faults-baked)  # the three baked-state faults and controls only (FAULTS_TRIALS of them)
      timeout 300 python3 bench/bench_faults.py --trials "${FAULTS_TRIALS:-64}" --workers 16 \
        --time-limit 240 --kinds control,mode,baked-value,superseded --seed "${FAULTS_SEED:-0}" \
        --json "$OUT/faults-baked.json" 2>&1 | tee "$OUT/faults-baked.log" | tail -30 ;;
    samples)  # the shipped samples and the docs' quotes of them, recorded again (make_samples.py)
      timeout 240 python3 scripts/make_samples.py 2>&1 | tee "$OUT/samples.log" | tail -8
      mkdir -p "$OUT/samples" && cp src/graphsan/report/samples/* README.md docs/te-3316.md "$OUT/samples/" ;;
    faults-snapshot)  # the same on the fallback: allocator snapshots (docs/coverage.md)
      GRAPHSAN_TRACELOG=0 timeout 540 python3 bench/bench_faults.py --trials 1000 --workers 16 \
        --time-limit 450 --seed "${FAULTS_SEED:-0}" --json "$OUT/faults-snapshot.json" 2>&1 \
        | tee "$OUT/faults-snapshot.log" | tail -40 ;;
    quantlinear)  # then where a step's device time goes, per recipe (--profile)
      timeout 300 python3 bench/bench_quant_linear.py --iters 10 --profile 2>&1 \
        | tee "$OUT/bench_quant_linear.log" | tail -50 ;;
    example)
      timeout 60 python3 examples/stale_input.py > "$OUT/example_off.log" 2>&1; echo "without graphsan: exit $?"
      grep -m1 -o "an illegal memory access[^.]*" "$OUT/example_off.log"
      timeout 60 python3 -m graphsan.cli run examples/stale_input.py > "$OUT/example.log" 2>&1
      echo "with graphsan: exit $?"; sed -n '/^graphsan.report.StaleMemoryError/,$p' "$OUT/example.log" ;;
    repro)
      timeout 330 python3 -m graphsan.cli repro --timeout 240 --json "$OUT/repro.json" 2>&1 | tee "$OUT/repro.log" | tail -60 ;;
    bench)
      timeout 240 python3 bench/bench_sanitizer.py --layers 32 --steps 30 --rounds 2 --repeats 1 2>&1 | tee "$OUT/bench_sanitizer.log" | tail -10 ;;
    quant)
      timeout 270 python3 -m pytest -q tests/lab/test_quant_triton_gpu.py tests/lab/test_quant_gemm_gpu.py ${QUANT_K:+-k "$QUANT_K"} \
        -p no:cacheprovider 2>&1 | tail -5
      timeout 220 python3 bench/bench_quant.py --iters 10 ${QUANT_SKIP_LINEAR:+--skip-linear} 2>&1 \
        | tee "$OUT/bench_quant.log" | grep -E "^\| (kernel|---|nvfp4|mxfp8)" ;;
    train)
      timeout 240 python3 bench/bench_train.py --iters 8 --out "$OUT/PERF-train.md" 2>&1 \
        | tee "$OUT/bench_train.log" | tail -14 ;;
    sweep)  # the quantize kernels' launch parameters side by side (the fused RHT/SR kernel too)
      timeout 240 python3 bench/tile_sweep.py --iters 10 2>&1 | tee "$OUT/tile_sweep.log" | tail -50 ;;
    ncu-quant)  # Nsight Compute on the NVFP4 column kernels at 8192x8192 bf16: the fused RHT+SR
      # kernel's two passes, the SR-only pass and the plain column kernel (occupancy, stalls, DRAM)
      timeout 300 ncu --clock-control none --target-processes all -k regex:'nvfp4_col_(fused|words)' \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats \
        python3 -c 'if 1:
          import torch
          from graphsan.lab.quant import NVFP4Options
          from graphsan.lab.quant.kernels import launch_nvfp4 as tk
          x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
          g = torch.Generator(device="cuda"); g.manual_seed(0)
          tk.nvfp4_quantize(x, 0, NVFP4Options(rht=True, generator=g))
          tk.nvfp4_quantize(x, 0, NVFP4Options(generator=g))
          tk.nvfp4_quantize(x, 0)
          torch.cuda.synchronize()' > "$OUT/ncu-quant.txt" 2>&1
      grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Size|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Ipc A|Waves Per SM|Block Limit Reg|Stall|Compute \(SM\) Th" "$OUT/ncu-quant.txt" | head -120 ;;
    rht)  # the RHT rows: their tiles and the quantize pass order (tile_sweep), then Nsight Compute
      # on the RHT+SR quantize pass given the post-RHT amax and on the two-amax pass (stalls)
      timeout 200 python3 bench/tile_sweep.py --iters 10 --only "nvfp4 col RHT+SR" \
        "nvfp4 RHT amax pass" 2>&1 | tee "$OUT/tile_sweep_rht.log" | tail -30
      timeout 200 ncu --clock-control none --target-processes all -k regex:'nvfp4_col_(fused|amax)' \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section InstructionStats \
        python3 -c 'if 1:
          import torch
          from graphsan.lab.quant import NVFP4Options
          from graphsan.lab.quant.kernels import launch_nvfp4 as tk
          x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
          g = torch.Generator(device="cuda"); g.manual_seed(0)
          tk.nvfp4_quantize_both(x, NVFP4Options(rht=True, generator=g))
          torch.cuda.synchronize()' > "$OUT/ncu-rht.txt" 2>&1
      grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|stall|Executed Ipc A" -i "$OUT/ncu-rht.txt" | head -80 ;;
    host)  # the host cost of one eager quantized module call, per recipe (bench_host.py)
      timeout 200 python3 bench/bench_host.py --iters 30 2>&1 | tee "$OUT/bench_host.log" | tail -10 ;;
    train-profile)  # where a step of bf16 graphed and super-mixed graphed goes (bench_train --profile)
      timeout 300 python3 bench/bench_train.py --iters 10 --profile --profile-steps 3 \
        --variants "bf16 graphed,super-mixed graphed" 2>&1 | tee "$OUT/train-profile.log" | tail -90 ;;
    scale)  # capture cost against live blocks and graph count (GRAPHSAN_TRACELOG=0: snapshots)
      timeout 330 python3 bench/bench_capture_scale.py 2>&1 | tee "$OUT/bench_capture_scale.log" | tail -22 ;;
    capture-profile)  # a cProfile of one graphsan process of the scale run (record, 20k blocks)
      timeout 120 python3 -m cProfile -o "$OUT/capture.prof" bench/bench_capture_scale.py \
        --child record --n-blocks 20000 --n-graphs 300 --n-nodes 100 > "$OUT/capture-child.log" 2>&1
      python3 -c 'import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats("tottime").print_stats(30); s.sort_stats("cumulative").print_stats(45)' \
        "$OUT/capture.prof" > "$OUT/capture-profile.txt" 2>&1
      grep -m1 RESULT "$OUT/capture-child.log"; head -70 "$OUT/capture-profile.txt" | tail -40 ;;
    tracker)  # the compiled tracker against real snapshots, and the sanitizer's GPU tests with
      # frees and allocation sites through its GPU-trace interpreter (waiting for its build)
      GRAPHSAN_TRACELOG=1 timeout 330 python3 -m pytest -q tests/test_gpu_allocview.py \
        tests/test_gpu_compiled_trace.py tests/test_tracelog.py tests/test_tracelog_compiled.py \
        tests/test_gpu_sanitizer.py tests/test_gpu_pin.py tests/test_gpu_offset_calc.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/tracker.log" | tail -15 ;;
    ranks)  # on the nvidia-h200-x2 kind only: the distributed lab on two GPUs
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
      timeout 200 python3 -m pytest -q -m gpu tests/lab/test_distributed.py tests/lab/test_repro_ranks.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/ranks-tests.log" | tail -8
      timeout 300 python3 -m graphsan.cli repro --nproc 2 --timeout 240 --report "$OUT/r" \
        --json "$OUT/repro-ranks.json" 2>&1 | tee "$OUT/repro-ranks.log" | tail -20
      python3 -m graphsan.cli report "$OUT"/r/case4.rank*.json 2>&1 | tail -30
      timeout 240 python3 bench/bench_train.py --iters 8 --nproc 2 --use-distributed-optimizer \
        --out "$OUT/PERF-train-ranks.md" 2>&1 | tee "$OUT/bench_train_ranks.log" | tail -16 ;;
    overhead)  # where a training step's time goes under graphsan (docs/PERF.md, Sanitizer)
      bash scripts/diag_replay.sh 2>&1 | tee "$OUT/overhead.log" | tail -45 ;;
    *) echo "unknown part $part (tests, sanitizer-tests, lab-tests, faults, example, repro, bench," \
         "quant, quantlinear, train, sweep, scale, tracker, overhead, ranks, faults-snapshot," \
         "capture-profile, tests-parallel, ncu-quant, train-profile, host, faults-baked, samples)" ;;
  esac
done
