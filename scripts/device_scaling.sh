#!/usr/bin/env bash
# On the device: data-parallel scaling of a full GRPO step (issue 9). The same case (same global
# batch: the prompts are split over the ranks) under torchrun on 1, 2, 4 and 8 GPUs, as many as
# the machine has, then `qerl bench scaling` (speedup and efficiency over the one-GPU step).
# Each GPU count is its own torchrun (a crash costs only that count); JSON, records and the log
# are bundled into $OUT/bundle.tgz after each. NVLink multicast stays off (the device README).
#   bash scripts/device_scaling.sh [SHAPE] [NEW_TOKENS]      # default qwen2.5-7b 2048
#   COUNTS="1 2" bash scripts/device_scaling.sh              # only these GPU counts
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then  # bitsandbytes for the 8-bit AdamW, where carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown} OMP_NUM_THREADS=4
SHAPE=${1:-qwen2.5-7b}; NEW=${2:-2048}
NGPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
W=/tmp/o; J=$W/json; R=$W/results; L=$W/scaling.log; mkdir -p $J $R
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a $L
S="--shape $SHAPE --prompts 8 --num-generations 8 --prompt-len 256 --max-new-tokens $NEW --micro-batch 8 --steps ${STEPS:-1}"
for n in ${COUNTS:-1 2 4 8}; do
  [ "$n" -le "$NGPU" ] || { echo "### dp$n: skipped, $NGPU GPU(s) here" | tee -a $L; continue; }
  echo "### dp$n: torchrun --nproc_per_node $n -m qerl bench step $S" | tee -a $L
  timeout ${T:-400} torchrun --standalone --nproc_per_node $n -m qerl bench step $S \
    --json $J/dp$n.json --record --results-dir $R --out /tmp/bs_dp$n 2>&1 | grep -v -i warn >> $L
  echo "### dp$n: exit $?" | tee -a $L
  grep -E "^(== |   )" $L | tail -3
  tar czf $OUT/bundle.tgz -C $W .
done
python3 -m qerl bench scaling $J/dp*.json --record --results-dir $R 2>&1 | tee -a $L
tar czf $OUT/bundle.tgz -C $W .
