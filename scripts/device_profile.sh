#!/usr/bin/env bash
# One device call: GPU rollout tests, then the decode-step profile (logs under $OUT).
set -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python3 -m pytest -q -x -s -p no:cacheprovider tests/test_rollout_gpu.py 2>&1 | tee $OUT/pytest_rollout.log | grep -E "logprob|passed|failed|Error" | tail -8
python3 scripts/profile_rollout.py ${LAYERS:-28} 2>&1 | grep -v Warning | tee $OUT/profile.log | tail -${TAIL:-120}
