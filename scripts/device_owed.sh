#!/usr/bin/env bash
# On the device: the GPU measurements issues 38 and 39 still owe, in three back-to-back calls
# (two and three back to back: the model's first half waits in /tmp while the machine is warm).
#   bash scripts/device_owed.sh one     # GPU tests of MoE and of two engines at once (issue 39, 38 §2.6);
#                                       # 7B GRPO steps: synchronous, max_staleness 1, bf16 (issue 38 §4)
#   bash scripts/device_owed.sh two     # carry .dev_w1 .whl: multi-turn speed, the model's first half
#   bash scripts/device_owed.sh three   # carry .dev_w2: the GPU default run, 3 seeds, timed (alone)
# Rows go to $OUT/results/*.jsonl, logs to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
R=$OUT/results; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case "${1:-one}" in
one)  # GPU tests (MoE, two engines at once), then 7B steps: synchronous vs max_staleness 1, and bf16
  PYTHONPATH=$PWD/src:$PWD/tests timeout 200 python3 -m pytest -q -p no:cacheprovider --tb=short \
    tests/test_moe_gpu.py tests/test_rollout_gpu.py 2>&1 | tee $OUT/pytest_gpu.log | tail -15
  J=$OUT/json; mkdir -p $J
  S="--shape qwen2.5-7b --prompts 8 --num-generations 8 --prompt-len 256 --max-new-tokens 2048 --lengths varied --steps 3"
  for c in "nvfp4_sync --quant nvfp4" "nvfp4_stale1 --quant nvfp4 --max-staleness 1" "bf16_sync --quant bf16"; do
    set -- $c; name=$1; shift
    left=$((575 - SECONDS)); [ $left -lt 60 ] && { echo "skip $name: ${left}s left"; continue; }
    timeout $left python3 -m qerl.bench.step $S "$@" --json $J/$name.json --record --results-dir $R --out /tmp/bs_$name \
      2>&1 | grep -v -i warn | tee -a $OUT/steps.log | grep -E "^(== |   )" | tail -6
  done
  [ -f $J/nvfp4_sync.json ] && [ -f $J/nvfp4_stale1.json ] && python3 -m qerl.bench.step --compare $J/nvfp4_stale1.json \
    $J/nvfp4_sync.json --target ">=1.4" --record --results-dir $R
  [ -f $J/bf16_sync.json ] && [ -f $J/nvfp4_stale1.json ] && python3 -m qerl.bench.step --compare $J/nvfp4_stale1.json \
    $J/bf16_sync.json --target ">=1.6" --record --results-dir $R ;;
two)  # multi-turn speed (issue 35's >= 0.8x), then the model's first half for three
  timeout 200 python3 scripts/multiturn_speed.py --results-dir $R 2>&1 | grep -v -i warn | tee $OUT/multiturn.log | tail -12
  bash scripts/device_study.sh carry1 2>&1 | tail -3 ;;
three)  # carry .dev_w2: the GPU default run, 3 seeds, timed (alone)
  bash scripts/device_default_run.sh bench 2>&1 | tail -30 ;;
esac
ls $R
