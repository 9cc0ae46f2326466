#!/usr/bin/env bash
# On the device (one H200): issue 32 §3. First the micro-benchmark (can decode and the update share
# the GPU?), then full 7B steps, synchronous vs max_staleness 1 (NVFP4, varied lengths, steady state),
# and bf16 LoRA synchronous, with the two comparisons recorded. Results under $OUT/results,
# JSON under $OUT/json, the log in $OUT/overlap.log.
#   bash scripts/device_overlap.sh [micro|steps|all]   (default all)
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
R=$OUT/results; J=$OUT/json; L=$OUT/overlap.log; mkdir -p $R $J
S="--shape qwen2.5-7b --prompts 8 --num-generations 8 --prompt-len 256 --max-new-tokens 2048 --lengths varied --steps 3"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a $L
what=${1:-all}
if [ "$what" = micro ] || [ "$what" = all ]; then
  timeout 400 python3 -m qerl.bench.overlap --json $J/overlap.json --record --results-dir $R 2>&1 \
    | grep -v -i warn | tee -a $L | tail -12
fi
if [ "$what" = steps ] || [ "$what" = all ]; then
  for c in "nvfp4_sync --quant nvfp4" "nvfp4_stale1 --quant nvfp4 --max-staleness 1" "bf16_sync --quant bf16"; do
    set -- $c; name=$1; shift
    timeout 300 python3 -m qerl.bench.step $S "$@" --json $J/$name.json --record --results-dir $R --out /tmp/bs_$name \
      2>&1 | grep -v -i warn | tee -a $L | grep -E "^(== |   )" | tail -6
  done
  python3 -m qerl.bench.step --compare $J/nvfp4_stale1.json $J/nvfp4_sync.json --target ">=1.4" --record --results-dir $R | tee -a $L
  python3 -m qerl.bench.step --compare $J/nvfp4_stale1.json $J/bf16_sync.json --target ">=1.6" --record --results-dir $R | tee -a $L
fi
