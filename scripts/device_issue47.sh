#!/usr/bin/env bash
# Issue 47's device steps in one call. Needs the humming-kernels wheel in .whl (carry it):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl humming-kernels==0.1.20
# STEP=kernels: GPU tests of the humming backend, then every candidate side by side on the 7B layer set.
# STEP=update: one 7B GRPO step with qerl's MMA layout (+ humming copies) and with humming's layout stored (one
#   copy): peak memory and update time before/after (issue 47 section 1).
# Give QERL_COMMIT literally (QERL_COMMIT=abc1234 ...): on 2026-12-07 `git rev-parse HEAD` on the device gave an
# older commit than the tree it ran (the rows were corrected by hand).
# Owed (2026-12-07, third session; H100 done at 1758d4c: per-shape kernels table with humming_nosplit, the rollout
# under it and in stream-K, one copy's rollout and GRPO step, GPU tests of humming/storage/lora_shrink/rollout/MoE/AQN):
# the H200, never started in three sessions: one call
#   QERL_COMMIT=<hash> STEP=card NO_ROLLOUT=1 TEST_S=200 BENCH_S=360 bash scripts/device_issue47.sh (tests, the table with
#   every candidate, routes), then KEEP_ROUTES=1 STEP=card NO_KERNELS=1 TEST_S=1 QUANTS=nvfp4,nvfp4_streamk,bf16 (rollout),
#   then KEEP_ROUTES=1 STEP=routed (the routed path bare and with LoRA r32 under the new table)
# then, on the same warm machine, KEEP_ROUTES=1 STEP=card NO_KERNELS=1 TESTS="tests/test_moe_gpu.py
# tests/test_aqn_families.py tests/test_humming_storage_gpu.py" QUANTS=nvfp4_one,nvfp4_one_streamk BATCHES=1,64,256;
# the one-copy rollout under the stored lists (9fa9c97: humming without split at small M, not yet measured); ncu of
# humming's repeatable modes on q|k|v (the idle-SM diagnosis is from tile counts); MoE section 3/5; section 4's profile.
# New candidate (not yet run anywhere): humming_ksplit2/4, a repeatable split-K through humming's grouped GEMM
# (kernels/humming_ksplit.py; tests/test_humming_ksplit_gpu.py), already a routes backend: --write-routes sends a
# shape to it where it measures fastest, and the rollout after that call runs it; for one copy (humming_storage) it
# reads the stored rows as its slices (stored_product; the GPU test checks the layout assumption bit for bit).
# Also new: bench mode humming_lora32_overlap (KernelSettings.lora_overlap: the shrink on a side stream), STEP=moe_kernels (humming's MoE GEMM against qerl's expert paths, kernels/humming_moe.py) and STEP=ncu.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,power.draw --format=csv
# KEEP_ROUTES=1: the routes an earlier call wrote on this warm machine (the tree is copied afresh each call)
[ -n "${KEEP_ROUTES:-}" ] && [ -f /tmp/qerl_routes.json ] && cp /tmp/qerl_routes.json src/qerl/kernels/routes.json && echo "routes from /tmp/qerl_routes.json"
case "${STEP:-kernels}" in
kernels)
  timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider --tb=short -x tests/test_humming_gpu.py 2>&1 | tee $OUT/pytest_humming.log | tail -15
  timeout ${BENCH_S:-330} python3 -m qerl.bench.kernels --record --results-dir $OUT/results --out $OUT \
    --models ${MODELS:-qwen2.5-7b} --ms ${MS:-1,8,16,32,64,128,256,512,2048} \
    --modes ${MODES:-bf16,nvfp4,nvfp4_lora32,wgmma,dequant,humming,humming_lora32} > $OUT/bench_stdout.log 2>&1
  tail -n 16 $OUT/bench_stdout.log
  [ -n "${MOE_GRAPHS:-}" ] && timeout 120 python3 -m pytest -q -p no:cacheprovider --tb=long -x tests/test_moe_gpu.py -k graphs 2>&1 | tee $OUT/pytest_moe_graphs.log | grep -E "Error|error|passed|failed|grouped_mm|\.py:[0-9]+" | head -30
  ;;
esac
case "${STEP:-kernels}" in
rollout)  # the engine, 7B LoRA r32: routed NVFP4, qerl's own kernels alone, bf16
  timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider --tb=short ${TESTS:-tests/test_humming_gpu.py} 2>&1 | tee $OUT/pytest.log | tail -12
  timeout ${ROLLOUT_S:-420} python3 -m qerl.bench.rollout --record --results-dir $OUT/results --out $OUT --skip-hf \
    --quants ${QUANTS:-nvfp4,nvfp4_own,bf16} --batches ${BATCHES:-1,8,64,128,256} --new-tokens ${NEW:-512} 2>&1 | grep -v Warning | tail -40
  ;;
esac
case "${STEP:-kernels}" in
check)  # GPU tests of the humming layout, the humming route, the MoE LoRA kernel and MoE graphs; then the engine
  timeout ${TEST_S:-260} python3 -m pytest -q -s -p no:cacheprovider --tb=short ${TESTS:-tests/test_humming_layout_gpu.py tests/test_humming_gpu.py tests/test_moe_lora_kernel_gpu.py tests/test_moe_gpu.py} 2>&1 | tee $OUT/pytest.log | grep -vE "^\s*$|Warning|warn" | tail -40
  if [ -n "${ROUTES:-}" ]; then  # this card's side-by-side table, written into the routes the rollout then reads
    timeout ${BENCH_S:-200} python3 -m qerl.bench.kernels --record --results-dir $OUT/results --out $OUT --write-routes \
      --models qwen2.5-7b --ms ${MS:-1,8,16,32,64,128,256,2048} --modes ${MODES:-bf16,nvfp4,routed,nvfp4_lora32,humming,humming_streamk,humming_nosplit,humming_lora32} \
      > $OUT/bench_stdout.log 2>&1; tail -n 12 $OUT/bench_stdout.log; cp src/qerl/kernels/routes.json $OUT/
  fi
  [ -n "${BATCHES:-}" ] && timeout ${ROLLOUT_S:-300} python3 -m qerl.bench.rollout --record --results-dir $OUT/results --out $OUT --skip-hf \
    --quants ${QUANTS:-nvfp4,nvfp4_own} --batches $BATCHES --new-tokens ${NEW:-512} 2>&1 | grep -v Warning | tail -24
  ;;
esac
case "${STEP:-kernels}" in
card)  # one call per card: GPU tests of the paths changed since the last device call, this card's routes
       # (kept in /tmp/qerl_routes.json for a later call on the same warm machine), then the rollout table
  timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider --tb=short -rfE ${TESTS:-tests/test_humming_ksplit_gpu.py tests/test_rollout_gpu.py tests/test_lora_shrink.py tests/test_humming_gpu.py tests/test_quant_head.py} 2>&1 | tee $OUT/pytest.log | grep -vE "^\s*$|Warning|warn" | tail -25
  [ -z "${NO_KERNELS:-}" ] && timeout ${BENCH_S:-170} python3 -m qerl.bench.kernels --record --results-dir $OUT/results --out $OUT --write-routes \
    --models qwen2.5-7b --ms ${MS:-1,8,16,32,64,128,256,2048} --modes ${MODES:-bf16,nvfp4,nvfp4_lora32,humming,humming_streamk,humming_nosplit,humming_ksplit2,humming_ksplit4,humming_lora32,humming_lora32_overlap} \
    > $OUT/bench_stdout.log 2>&1; tail -n ${TAIL:-24} $OUT/bench_stdout.log; cp src/qerl/kernels/routes.json $OUT/; cp src/qerl/kernels/routes.json /tmp/qerl_routes.json
  left=$((${LIMIT:-585} - SECONDS))
  [ -z "${NO_ROLLOUT:-}" ] && timeout $left python3 -m qerl.bench.rollout --record --results-dir $OUT/results --out $OUT --skip-hf \
    --quants ${QUANTS:-nvfp4,bf16} --batches ${BATCHES:-1,8,64,128,256} --new-tokens ${NEW:-512} 2>&1 | grep -vE "Warning|ms/step" | tee $OUT/rollout.log | tail -30
  ;;
esac
case "${STEP:-kernels}" in
routed)  # after a call that wrote this card's routes (KEEP_ROUTES=1): what layers run, bare and with LoRA r32
  timeout ${BENCH_S:-200} python3 -m qerl.bench.kernels --record --results-dir $OUT/results --out $OUT --models qwen2.5-7b \
    --ms ${MS:-1,16,64,128,256,2048} --modes bf16,nvfp4,routed,routed_lora32 > $OUT/bench_stdout.log 2>&1; tail -n 12 $OUT/bench_stdout.log
  ;;
esac
case "${STEP:-kernels}" in
moe_kernels)  # one Qwen3-30B-A3B MoE layer's experts: qerl's loop / grouped / GEMV against humming's MoE GEMM
  timeout ${TEST_S:-120} python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_humming_moe_gpu.py 2>&1 | tail -8
  timeout ${BENCH_S:-240} python3 scripts/moe_gemv_speed.py --humming --record --results-dir $OUT/results \
    --batches ${BATCHES:-1,8,64,512,2048} 2>&1 | grep -v Warning | tail -20
  ;;
esac
case "${STEP:-kernels}" in
ncu)  # humming's modes, the split-K candidate and qerl's own on q|k|v and down, one launch each (scripts/profile_humming.py)
  timeout ${NCU_S:-240} ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats python3 scripts/profile_humming.py ${MS:-1 64 256} > $OUT/ncu.log 2>&1
  grep -E "^range:|^  [a-zA-Z_].*\(|DRAM Throughput|Achieved Occupancy|Grid Size|Duration|Registers Per|Stall" $OUT/ncu.log | head -${TAIL:-200}
  ;;
esac
case "${STEP:-kernels}" in
profile)  # where one 7B decode step's time goes, by kernel kind, nvfp4 and bf16 (issue 47 section 4)
  timeout ${PROFILE_S:-300} python3 scripts/profile_decode.py --skip-attention ${SHRINK:+--shrink} ${SKIP_STEP:+--skip-step} --quants ${QUANTS:-nvfp4,bf16} \
    --batches ${BATCHES:-1,64} --out $OUT 2>&1 | grep -v Warning | tail -${TAIL:-70}
  ;;
esac
case "${STEP:-kernels}" in
moe)  # one Qwen3-30B-A3B GRPO step at defaults (MoE decode from graphs): rollout tok/s and peak memory
  LIMIT=${LIMIT:-400} SHAPE=${SHAPE:-qwen3-30b-a3b} NEW=${NEW:-256} KV=${KV:-3.4} bash scripts/device_moe.sh step
  ;;
esac
case "${STEP:-kernels}" in
update)  # the GRPO step (rollout + update) with the MMA layout and with humming's layout stored: memory and time
  for hs in "" "--humming-storage"; do
    timeout ${STEP_S:-280} python3 -m qerl.bench.step --shape qwen2.5-7b --max-new-tokens ${NEW:-512} --steps ${STEPS:-2} --record \
      --results-dir $OUT/results --out $OUT/step $hs --json $OUT/step${hs:+_one}.json 2>&1 | grep -v Warning | tail -${TAIL:-12}
  done
  ;;
esac
