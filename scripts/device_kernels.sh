#!/usr/bin/env bash
# One device call: GPU kernel tests, the tile sweep, the full kernel benchmark (recorded under $OUT/results).
set -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
python3 -m pytest -q -x -p no:cacheprovider tests/test_w4_kernels.py 2>&1 | tee $OUT/pytest.log | tail -8
python3 -m qerl.bench.kernels ${SWEEP:+--sweep} --record --results-dir $OUT/results --out $OUT 2>&1 > $OUT/bench_stdout.log
tail -n 48 $OUT/bench_stdout.log; grep "sweep M=" $OUT/bench_kernels.log
