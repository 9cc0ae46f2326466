#!/usr/bin/env bash
# On the device: the default run's learning-rate/steps sweep (parallel, not timed) or its timed
# 3-seed benchmark. The SmolLM2 NVFP4 checkpoint arrives in two parts carried by two earlier calls
# into /tmp/parts (a call carries at most 64 MiB) plus .dev_small; reasoning-gym and its needs as .whl.
#   bash scripts/device_default_run.sh sweep|bench
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown} QERL_CACHE=/tmp/qerl_cache
M=$QERL_CACHE/SmolLM2-135M-Instruct
P=/tmp/parts; [ -f .dev_p1/part ] && cp .dev_p1/part $P/p1; [ -f .dev_p2/part ] && cp .dev_p2/part $P/p2  # carried in earlier calls
mkdir -p $M && cp .dev_small/* $M/ && cat $P/p1 $P/p2 > $M/model.safetensors
[ "$(sha256sum $M/model.safetensors | cut -d' ' -f1)" = "$(cat $M/model.sha256)" ] || { echo "model parts corrupt"; exit 1; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case "${1:-sweep}" in
sweep)
  CPUCFG="--generation_batch_size 32 --per_device_train_batch_size 32 --eval_num_samples 2 --optim adamw_torch --dtype float32"
  run() {  # name, args...
    local name=$1; shift
    OMP_NUM_THREADS=2 timeout ${T:-500} python3 -m qerl train --output_dir /tmp/sweep/$name --rollout_kv_cache_gb 4 \
      --eval_steps 10 --report_to none "$@" > /tmp/sweep_$name.log 2>&1 || echo "$name: exit $?" >> /tmp/sweep_$name.log
    mkdir -p $OUT/sweep/$name && cp /tmp/sweep_$name.log $OUT/sweep/$name/log.txt
    cp /tmp/sweep/$name/metrics.jsonl $OUT/sweep/$name/ 2>/dev/null || true
  }
  for lr in 1e-4 2e-4 4e-4; do for s in 0 1; do
    run cpu_lr${lr}_s$s $CPUCFG --max_steps 40 --learning_rate $lr --seed $s &
  done; done
  run gpu_lr1e-4_s0 --learning_rate 1e-4 --seed 0 &
  run gpu_lr2e-4_s0 --learning_rate 2e-4 --seed 0 &
  wait
  python3 - <<'PY'
import json, os, glob
print(f"{'run':22s} {'steps':>5s} {'evals (step: pass@1 %)':s}")
for d in sorted(glob.glob(os.environ["OUT"] + "/sweep/*")):
    try:
        rows = [json.loads(x) for x in open(d + "/metrics.jsonl")]
    except OSError:
        print(os.path.basename(d), "no metrics"); continue
    ev = [(r["step"], round(100 * r["eval_pass_at_1"], 1)) for r in rows if "eval_pass_at_1" in r]
    st = [r for r in rows if "reward_mean" in r]
    t = sum(r.get("time_step", 0) for r in st)
    print(f"{os.path.basename(d):22s} {len(st):5d} {ev}  train-time {t:.0f}s")
PY
  ;;
bench)
  timeout ${T:-560} python3 -m qerl.bench.default_run --record --results-dir $OUT/results --out /tmp/bench_default ${SEEDS:+--seeds $SEEDS} || echo "bench: exit $?"
  # one archive: the device returns at most 8 files a call
  (cd /tmp/bench_default && tar czf $OUT/bench.tgz bench.log seed*/metrics.jsonl seed*/stdout.log seed*/curves.png 2>/dev/null || true)
  ;;
esac
