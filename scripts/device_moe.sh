#!/usr/bin/env bash
# On the device: issue 39's GPU steps for MoE.
#   bash scripts/device_moe.sh kernels   # GPU tests of the MoE paths (loop, grouped, decode GEMV), then one
#                                        # expert layer's speed: loop vs grouped vs GEMV (Qwen3-30B-A3B, gpt-oss-20b)
#   bash scripts/device_moe.sh step      # GRPO steps of random-weight MoE models in real shapes: peak memory
# Logs go to $OUT, rows to $OUT/results/*.jsonl.
set -uo pipefail
export PYTHONPATH=$PWD/src:$PWD/tests PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
R=$OUT/results; mkdir -p $R
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case "${1:-kernels}" in
kernels)
  timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_moe_dequant.py tests/test_moe_gemv.py tests/test_moe_grouped.py \
    tests/test_moe_gpu.py 2>&1 | tee $OUT/pytest_moe.log | tail -15
  echo "== Qwen3-30B-A3B expert layer (nvfp4, 128 experts, top-8)"
  timeout 150 python3 scripts/moe_gemv_speed.py --profile --record --results-dir $R 2>&1 | grep -v -i warn | tee $OUT/speed_qwen3.log
  echo "== gpt-oss-20b expert layer (mxfp4, 32 experts, top-4)"
  timeout 150 python3 scripts/moe_gemv_speed.py --experts 32 --hidden 2880 --inter 2880 --top-k 4 --format mxfp4 --record --results-dir $R \
    2>&1 | grep -v -i warn | tee $OUT/speed_gptoss.log ;;
esac
ls $R
