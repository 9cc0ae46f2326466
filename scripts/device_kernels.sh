#!/usr/bin/env bash
# One device call: GPU kernel tests, the launch-shape sweep, the kernel benchmark (recorded under
# $OUT/results), then ncu on the MMA kernel at M = 1, 16, 64. Usage on the device:
#   QERL_COMMIT=<sha> SWEEP=1 bash scripts/device_kernels.sh
set -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_w4_mma_gpu.py 2>&1 | tee $OUT/pytest.log | tail -25
timeout ${BENCH_S:-300} python3 -m qerl.bench.kernels ${SWEEP:+--sweep} --record --results-dir $OUT/results --out $OUT \
  ${MS:+--ms $MS} ${MODELS:+--models $MODELS} > $OUT/bench_stdout.log 2>&1
grep "sweep" $OUT/bench_kernels.log; tail -n 32 $OUT/bench_stdout.log
if [ -n "${NCU:-}" ]; then
  timeout ${NCU_S:-150} ncu --clock-control none -k regex:w4_mma_matmul --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section InstructionStats \
    python3 scripts/profile_kernels.py 1 16 64 > $OUT/ncu.log 2>&1
  grep -E "w4_mma_matmul|DRAM Throughput|Achieved Occupancy|Registers Per|Grid Size|Executed Ipc A|Duration|Warp Cycles Per Issued" $OUT/ncu.log | head -120
fi
if [ -n "${ROLLOUT:-}" ]; then  # the engine: NVFP4 vs bf16 LoRA through the same engine (7B, r32)
  [ -n "${ROLLOUT_TESTS:-}" ] && timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_rollout_gpu.py 2>&1 | tee $OUT/pytest_rollout.log | tail -4
  timeout ${ROLLOUT_S:-240} python3 -m qerl.bench.rollout --record --results-dir $OUT/results --out $OUT --skip-hf \
    --batches ${BATCHES:-1,8,64} --new-tokens ${NEW:-1024} --ratio-targets "1:>=1.8,8:>=1.8" 2>&1 | grep -v Warning | tail -14
fi
