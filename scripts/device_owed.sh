#!/usr/bin/env bash
# On the device: the GPU measurements issues 38 and 39 still owe, in three back-to-back calls
# (the machine must stay warm between them: the model's first half waits in /tmp).
#   bash scripts/device_owed.sh one     # carry .dev_w1 .whl: GPU tests of MoE and of two engines at
#                                       # once (issue 39, 38 §2.6), multi-turn speed (issue 35's 0.8x)
#   bash scripts/device_owed.sh two     # carry .dev_w2: the GPU default run, 3 seeds, timed (alone)
#   bash scripts/device_owed.sh three   # rollout beside the update: 7B steps sync vs max_staleness 1
# Rows go to $OUT/results/*.jsonl, logs to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
R=$OUT/results; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case "${1:-one}" in
one)
  bash scripts/device_study.sh carry1 2>&1 | tail -3
  PYTHONPATH=$PWD/src:$PWD/tests timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short \
    tests/test_moe_gpu.py tests/test_rollout_gpu.py 2>&1 | tee $OUT/pytest_gpu.log | tail -15
  timeout $((560 - SECONDS)) python3 scripts/multiturn_speed.py --results-dir $R 2>&1 | grep -v -i warn \
    | tee $OUT/multiturn.log | tail -12 ;;
two)
  bash scripts/device_default_run.sh bench 2>&1 | tail -30 ;;
three)
  bash scripts/device_overlap.sh steps 2>&1 | tail -30 ;;
esac
ls $R
