"""Importing qerl and its libraries prints nothing on stderr (bitsandbytes >= 0.50, imported by peft, logs a
failed hub lookup for a CPU kernel on AVX512-BF16 CPUs; every run's stderr carried it)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_qerl_then_peft_is_quiet():
    r = subprocess.run([sys.executable, "-c", "import qerl, peft"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "gemm_4bit_forward" not in r.stderr, r.stderr[-500:]
