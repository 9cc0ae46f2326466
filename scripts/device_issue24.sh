#!/usr/bin/env bash
# Two back-to-back device calls for the issue-23/24 figures (the machine stays warm between them:
# /tmp keeps the first half of the SmolLM2 wheel and the installed wheels).
#   bash scripts/device_issue24.sh one   # carry .dev_w1 .whl: GPU tests, rollout batch 1/8, multi-turn speed
#   bash scripts/device_issue24.sh two   # carry .dev_w2: study fixed vs adaptive AQN (3 seeds, = the default
#                                        # run's 3 seeds) beside the tool-use recipe, before/after
set -uo pipefail
export QERL_COMMIT=${QERL_COMMIT:-unknown} PYTHONUNBUFFERED=1
mkdir -p $OUT/results
case "${1:-one}" in
one)
  bash scripts/device_study.sh carry1 | tail -3
  export PYTHONPATH=/tmp/site:$PWD/src
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_trainer_gpu.py tests/test_rollout_gpu.py \
    tests/test_decode_attention.py tests/test_engine_runner.py tests/test_lora_shrink.py tests/test_aqn_fp32.py \
    2>&1 | tee $OUT/pytest_gpu.log | tail -4
  timeout 150 python3 -m qerl.bench.rollout --record --results-dir $OUT/results --out $OUT --batches 1,8 --skip-hf \
    2>&1 | grep -v Warning | grep -E "batch|x " | tail -8
  timeout 150 python3 scripts/multiturn_speed.py --results-dir $OUT/results 2>&1 | grep -v Warning | tail -10
  ;;
two)
  # the recipe: the default run's settings on the tool task (a one-shot call example in the prompt),
  # completions long enough for a call, its response and an answer
  (sleep 60; export PYTHONPATH=/tmp/site:$PWD/src QERL_CACHE=/tmp/qerl_cache OMP_NUM_THREADS=1
   timeout 480 python3 -m qerl train --dataset_name tool_arithmetic --dataset_config '{example: true}' \
     --max_completion_length 96 --max_turns 2 --eval_limit 100 --output_dir /tmp/tool_recipe \
     --rollout_kv_cache_gb 2 --report_to none > $OUT/tool_recipe.log 2>&1
   cp /tmp/tool_recipe/metrics.jsonl $OUT/tool_recipe_metrics.jsonl 2>/dev/null) &
  ARMS=nvfp4_aqn,nvfp4_aqn_adaptive SEEDS=0,1,2 PAR=6 END=${END:-560} bash scripts/device_study.sh run
  wait; tail -25 $OUT/tool_recipe.log
  ;;
esac
