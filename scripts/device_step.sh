#!/usr/bin/env bash
# On the device: full GRPO steps at 7B-72B shapes (issue 7). Each case is its own process
# (clean peak-memory counters, a crash or OOM costs only that case); JSON per case, the records
# and the log are bundled into $OUT/bundle.tgz after each case (a call returns at most 8 files,
# and one cut off at its time limit keeps what finished). Comparisons can be recorded here too
# (`qerl bench step --compare`), from the JSON files.
#   bash scripts/device_step.sh a|b|c|e|levers|v  (e: issue 23 in one call; a: 7B + TRL + levers, b: 14B, c: 72B and 32B under caps + 32B rollout,
#   v: 7B NVFP4 vs bf16 LoRA with completions that end at varied lengths, mean 40 % of the limit: --lengths varied;
#   s1-s4: issue 23's steady-state re-runs, each step figure the mean of the timed steps after the first:
#   s1 7B varied both sides (+ profiles of the update) and 7B NVFP4 max length, s2 qerl vs TRL at 256 new and
#   32B under a 40 GB cap, s3 14B varied both sides, s4 72B under an 80 GB cap)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl7/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
W=/tmp/o; rm -rf $W; J=$W/json; R=$W/results; L=$W/step.log; mkdir -p $J $R  # bundled into $OUT after each case
S="--prompts 8 --num-generations 8 --prompt-len 256"
run() {  # name, timeout, module, args...
  local name=$1 t=$2 mod=$3; shift 3
  echo "### $name: $mod $*" | tee -a $L
  timeout $t python3 -m qerl.bench.$mod "$@" --json $J/$name.json --record --results-dir $R --out /tmp/bs_$name \
    2>&1 | grep -v -i "warn" >> $L
  echo "### $name: exit $?" >> $L
  grep -E "^(== |   )" $L | tail -5
  tar czf $OUT/bundle.tgz -C $W .
}
cmp() {  # a, b, metric, target
  python3 -m qerl.bench.step --compare $J/$1.json $J/$2.json --metric $3 ${4:+--target "$4"} --record --results-dir $R \
    2>&1 | tee -a $L
}
rollout32() {  # the rollout at the 32B shape, batch 8: NVFP4 vs bf16 LoRA on the same engine
  timeout ${T32:-200} python3 -m qerl.bench.rollout --model qwen2.5-32b --batches 8 --new-tokens 512 --skip-hf \
    --ratio-targets "8:>=2.5" --record --results-dir $R --out $W 2>&1 | grep -v -i warn | tee -a $L | tail -12
  tar czf $OUT/bundle.tgz -C $W .
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case "$1" in
a)
  timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_device_memory_gpu.py 2>&1 | tail -3 | tee -a $L
  run 7b_trl_256 200 trl_step --shape qwen2.5-7b --max-new-tokens 256 $S
  run 7b_nvfp4 200 step --shape qwen2.5-7b --max-new-tokens 2048 $S
  run 7b_bf16 200 step --shape qwen2.5-7b --quant bf16 --max-new-tokens 2048 $S
  run 7b_levers_256 240 step --shape qwen2.5-7b --max-new-tokens 256 $S --sweep-levers
  cmp 7b_levers_256 7b_trl_256 step_s ">=5"
  cmp 7b_nvfp4 7b_bf16 step_s ">=1.8"
  cmp 7b_nvfp4 7b_bf16 rollout_s
  cmp 7b_nvfp4 7b_bf16 update_s
  ;;
b)
  run 14b_nvfp4 260 step --shape qwen2.5-14b --max-new-tokens 2048 $S
  run 14b_bf16 260 step --shape qwen2.5-14b --quant bf16 --max-new-tokens 2048 $S
  cmp 14b_nvfp4 14b_bf16 step_s ">=1.8"
  cmp 14b_nvfp4 14b_bf16 rollout_s
  cmp 14b_nvfp4 14b_bf16 update_s
  rollout32
  ;;
levers)  # the GPU tests of the cap, then the 7B lever sweep on its own
  timeout 60 python3 -m pytest -q -p no:cacheprovider -p no:warnings tests/test_device_memory_gpu.py 2>&1 | tail -4
  run 7b_levers_256 150 step --shape qwen2.5-7b --max-new-tokens 256 $S --sweep-levers
  ;;
v)  # the 7B step of case a at realistic lengths: each completion ends at its own limit (5-75 % of 2048)
  run 7b_nvfp4_varied 240 step --shape qwen2.5-7b --max-new-tokens 2048 --lengths varied $S
  run 7b_bf16_varied 240 step --shape qwen2.5-7b --quant bf16 --max-new-tokens 2048 --lengths varied $S
  cmp 7b_nvfp4_varied 7b_bf16_varied step_s ">=1.3"
  cmp 7b_nvfp4_varied 7b_bf16_varied rollout_s
  cmp 7b_nvfp4_varied 7b_bf16_varied update_s
  ;;
e)  # issue 23's essentials in one call: fused-group training check, qerl vs TRL at 256 new, NVFP4 vs bf16 at varied lengths
  timeout 90 python3 scripts/fused_lora_train_gpu.py --out $W/fused --iters 5 2>&1 | grep -v -i warn | tail -12 | tee -a $L
  run 7b_nvfp4_256 150 step --shape qwen2.5-7b --max-new-tokens 256 $S
  run 7b_trl_256 170 trl_step --shape qwen2.5-7b --max-new-tokens 256 $S
  cmp 7b_nvfp4_256 7b_trl_256 step_s ">=5"
  cmp 7b_nvfp4_256 7b_trl_256 update_s
  run 7b_nvfp4_varied 200 step --shape qwen2.5-7b --max-new-tokens 2048 --lengths varied $S
  run 7b_bf16_varied 200 step --shape qwen2.5-7b --quant bf16 --max-new-tokens 2048 --lengths varied $S
  cmp 7b_nvfp4_varied 7b_bf16_varied step_s ">=1.3"
  cmp 7b_nvfp4_varied 7b_bf16_varied rollout_s
  cmp 7b_nvfp4_varied 7b_bf16_varied update_s
  ;;
s1)
  run 7b_nvfp4_varied 300 step --shape qwen2.5-7b --max-new-tokens 2048 --lengths varied $S --steps 2 --profile
  run 7b_bf16_varied 240 step --shape qwen2.5-7b --quant bf16 --max-new-tokens 2048 --lengths varied $S --steps 2 --profile
  cmp 7b_nvfp4_varied 7b_bf16_varied step_s ">=1.3"
  cmp 7b_nvfp4_varied 7b_bf16_varied rollout_s
  cmp 7b_nvfp4_varied 7b_bf16_varied update_s
  run 7b_nvfp4 240 step --shape qwen2.5-7b --max-new-tokens 2048 $S --steps 2
  ;;
s2)
  run 7b_nvfp4_256 150 step --shape qwen2.5-7b --max-new-tokens 256 $S --steps 2
  run 7b_trl_256 170 trl_step --shape qwen2.5-7b --max-new-tokens 256 $S
  cmp 7b_nvfp4_256 7b_trl_256 step_s ">=5"
  cmp 7b_nvfp4_256 7b_trl_256 update_s
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run 32b_cap40GB 200 step --shape qwen2.5-32b --prompts 8 \
    --num-generations 2 --prompt-len 256 --max-new-tokens 2048 --micro-batch 1 --kv-cache-gb 9.01 --memory-cap-gb 37.25 \
    --peak-target "<=37.25" --steps 1
  ;;
m32)  # 32B under a 40 GB cap alone
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run 32b_cap40GB 240 step --shape qwen2.5-32b --prompts 8 \
    --num-generations 2 --prompt-len 256 --max-new-tokens 2048 --micro-batch 1 --kv-cache-gb 9.01 --memory-cap-gb 37.25 \
    --peak-target "<=37.25" --steps 1
  ;;
s3)
  run 14b_nvfp4_varied 300 step --shape qwen2.5-14b --max-new-tokens 2048 --lengths varied $S --steps 2
  run 14b_bf16_varied 260 step --shape qwen2.5-14b --quant bf16 --max-new-tokens 2048 --lengths varied $S --steps 2
  cmp 14b_nvfp4_varied 14b_bf16_varied step_s ">=1.3"
  cmp 14b_nvfp4_varied 14b_bf16_varied rollout_s
  cmp 14b_nvfp4_varied 14b_bf16_varied update_s
  ;;
s4)
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run 72b_cap80GB 420 step --shape qwen2.5-72b --prompts 8 \
    --num-generations 2 --prompt-len 256 --max-new-tokens 2048 --micro-batch 1 --kv-cache-gb 11.26 --memory-cap-gb 74.5 \
    --peak-target "<=74.5" --steps 1
  ;;
c)
  # caps in GiB equal to 40 GB and 80 GB (decimal); expandable segments keep reserved close to allocated
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run 72b_cap80GB 330 step --shape qwen2.5-72b --prompts 8 \
    --num-generations 2 --prompt-len 256 --max-new-tokens 2048 --micro-batch 1 --kv-cache-gb 11.26 --memory-cap-gb 74.5 \
    --peak-target "<=74.5"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True run 32b_cap40GB 170 step --shape qwen2.5-32b --prompts 8 \
    --num-generations 2 --prompt-len 256 --max-new-tokens 2048 --micro-batch 1 --kv-cache-gb 9.01 --memory-cap-gb 37.25 \
    --peak-target "<=37.25"
  rollout32
  ;;
esac
tar czf $OUT/bundle.tgz -C $W .
echo "=== summary"; grep -E "^(== |   step|   completions|   memory|   OUT|### .*exit|.* vs .*->)" $L | tail -60
