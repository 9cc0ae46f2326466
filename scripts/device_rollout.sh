#!/usr/bin/env bash
# One device call: GPU rollout tests, then the rollout benchmark (recorded under $OUT/results).
set -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
python3 -m pytest -q -x -p no:cacheprovider tests/test_rollout_gpu.py 2>&1 | tee $OUT/pytest_rollout.log | tail -5
python3 -m qerl.bench.rollout --record --results-dir $OUT/results --out $OUT ${ROLLOUT_ARGS:-} 2>&1 | grep -v Warning | tail -40
