#!/usr/bin/env bash
# One device call for the engine (issue 20): GPU tests, decode attention + step profile, rollout bench.
# Knobs: STEPS (default 1: run the profile), BENCH (default "1,8,64"), KV ("64:4096" to compare FP8 KV),
# HF (1: include the Hugging Face baselines), TESTS (default 1).
set -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
mkdir -p $OUT/results
if [ "${TESTS:-1}" = 1 ]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_attention.py tests/test_rollout_gpu.py \
    tests/test_aqn_fp32.py 2>&1 | tee $OUT/pytest_engine.log | tail -8
fi
if [ "${STEPS:-1}" = 1 ]; then
  timeout ${PROFILE_TIMEOUT:-200} python3 scripts/profile_decode.py --out $OUT ${PROFILE_ARGS:-} 2>&1 | grep -v Warning \
    | grep -E "^attn|tiles|^shrink|fused_attention|   [A-Za-z]|copy bandwidth" | head -160
fi
if [ -n "${BENCH:-1,8,64}" ] && [ "${BENCH:-x}" != none ]; then
  SKIP=--skip-hf; [ "${HF:-0}" = 1 ] && SKIP="--hf-new-tokens 32"
  timeout ${BENCH_TIMEOUT:-280} python3 -m qerl.bench.rollout --record --results-dir $OUT/results --out $OUT \
    --batches ${BENCH:-1,8,64} $SKIP ${ROLLOUT_ARGS:-} 2>&1 | grep -v Warning | tail -25
fi
if [ -n "${KV:-}" ]; then
  timeout ${KV_TIMEOUT:-200} python3 -m qerl.bench.rollout --record --results-dir $OUT/results --out $OUT \
    --kv-compare $KV 2>&1 | grep -v Warning | tail -12
fi
