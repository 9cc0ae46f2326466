#!/usr/bin/env bash
# One device call for issue 31's wgmma kernel, in the order that decides what comes next:
#   1. GPU tests of both NVFP4 kernels (bits v2 changed the mma.sync decode too) and the wgmma kernel;
#   2. the kernel benchmark with the wgmma tile sweep (recorded under $OUT/results), wgmma columns beside
#      the routed path, cuBLAS bf16 and tinygemm;
#   3. NCU=1: ncu on both kernels at M = 1, 64, 256 (DRAM throughput, occupancy, issue, stalls).
# Usage on the device:  QERL_COMMIT=<sha> NCU=1 bash scripts/device_wgmma.sh
# If step 1 passes, make KernelSettings.wgmma default to True (kernels/settings.py) and record the routes (w4_wgmma.MIN_M/MAX_M) from step 2.
set -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
timeout ${TEST_S:-300} python3 -m pytest -q -x -p no:cacheprovider --tb=short tests/test_w4_wgmma_gpu.py \
  tests/test_w4_mma_gpu.py 2>&1 | tee $OUT/pytest.log | tail -25
timeout ${BENCH_S:-360} python3 -m qerl.bench.kernels --wgmma-sweep --record --results-dir $OUT/results --out $OUT \
  --ms ${MS:-1,8,16,32,64,128,256,2048} --models ${MODELS:-qwen2.5-7b} > $OUT/bench_stdout.log 2>&1
grep "sweep" $OUT/bench_kernels.log; tail -n 16 $OUT/bench_stdout.log
if [ -n "${NCU:-}" ]; then
  timeout ${NCU_S:-150} ncu --clock-control none -k regex:"w4_mma_matmul|w4_wgmma_matmul" --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats --section InstructionStats \
    python3 scripts/profile_kernels.py --wgmma 1 64 256 > $OUT/ncu.log 2>&1
  grep -E "w4_(wg)?mma_matmul|DRAM Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Duration|Warp Cycles Per Issued" \
    $OUT/ncu.log | head -120
fi
