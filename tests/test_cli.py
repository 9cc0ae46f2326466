"""The qerl command line, run as a user runs it."""

import json
import subprocess
import sys

import pytest
from tiny_models import save_tiny


def qerl(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "qerl", *map(str, args)], capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"qerl {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def test_quantize_then_inspect_the_checkpoint(tmp_path):
    save_tiny(tmp_path / "dense", "llama")
    out = qerl("quantize", tmp_path / "dense", tmp_path / "ct", "--format", "nvfp4")
    assert "wrote nvfp4 checkpoint" in out.stdout
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    rows = [json.loads(x) for x in qerl("inspect", tmp_path / "dense", "--quant", "mxfp4", "--json").stdout.splitlines()]
    assert len(rows) == 15 and rows[-1]["n_layers"] == 14
    assert all(0.02 < r["rel_error"] < 0.2 for r in rows[:-1])


def test_errors_are_one_clear_line(tmp_path):
    p = qerl("quantize", tmp_path / "nope", tmp_path / "out", check=False)
    assert p.returncode == 2
    assert "error:" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_main_job_inspects_smollm2():
    """The README's main-job command: SmolLM2 quantized to NVFP4 on the CPU, report per layer."""
    p = qerl("inspect")
    assert "model.layers.29.mlp.down_proj" in p.stdout
    ratio = float(p.stdout.split("linear weights")[1].split("(")[1].split("x")[0])
    assert 0.27 < ratio < 0.29  # 4.5 bits of 16 (+ the per-tensor scale)
