#!/usr/bin/env bash
# The wgmma kernel on the device, in an order where a fault cannot take down what follows: each step
# is its own process, and the timings run only after the kernel is proven right.
#   1. the mma.sync kernel's GPU tests (bits v2 changed its decode too), then the wgmma kernel's
#      (every M 1-300 first), then every tile's registers / local memory / occupancy on the driver;
#   2. only if 1 passed: the kernel benchmark (wgmma beside the routed path and cuBLAS bf16);
#      WGSWEEP=1 adds the tile sweep first;
#   3. NCU=1 (best in a second call): ncu on the wgmma kernel at M = 64 and 256.
# Fits one 600-s call: 100 + 150 + 30 + 190 (+ 70 with NCU) s of limits.
# Usage on the device:  QERL_COMMIT=<sha> bash scripts/device_wgmma.sh
set -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv,noheader
ok=1
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 100 python3 -m pytest -q -p no:cacheprovider --tb=short --maxfail=3 tests/test_w4_mma_gpu.py 2>&1 \
    | tee $OUT/pytest_mma.log | tail -6 || echo "mma.sync tests FAILED"
  timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short --maxfail=3 tests/test_w4_wgmma_gpu.py 2>&1 \
    | tee $OUT/pytest_wgmma.log | tail -12
  rc=${PIPESTATUS[0]}  # 124: out of time, not wrong; the bench still runs (in its own process)
  [ $rc = 0 ] || [ $rc = 124 ] || { echo "wgmma tests FAILED ($rc)"; ok=0; }
  timeout 30 python3 scripts/wgmma_tiles.py 2>&1 | tee $OUT/tiles.log || { echo "wgmma tiles FAILED"; ok=0; }
fi
if [ $ok = 1 ]; then
  timeout ${BENCH_S:-190} python3 -m qerl.bench.kernels ${WGSWEEP:+--wgmma-sweep} --record --results-dir $OUT \
    --out $OUT --ms ${MS:-1,8,16,32,64,128,256} --models qwen2.5-7b \
    --modes ${MODES:-nvfp4_lora32,wgmma,wgmma_lora32,wgmma_lora32_fused} > $OUT/bench_stdout.log 2>&1
  grep "sweep" $OUT/bench_kernels.log; tail -n 12 $OUT/bench_stdout.log
else
  timeout ${BENCH_S:-200} python3 -m qerl.bench.kernels --out $OUT --ms 1,16,64 --models qwen2.5-7b --modes bf16 \
    > $OUT/bench_stdout.log 2>&1; tail -n 8 $OUT/bench_stdout.log
fi
if [ -n "${NCU:-}" ] && [ $ok = 1 ]; then
  timeout 70 ncu --clock-control none -k regex:"w4_wgmma_matmul" --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \
    python3 scripts/profile_kernels.py --wgmma ${NCU_MS:-64 256} > $OUT/ncu.log 2>&1
  grep -E "w4_wgmma_matmul|DRAM Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Duration|Stall|Warp Cycles Per Issued" \
    $OUT/ncu.log | head -60
fi
