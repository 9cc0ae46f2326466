"""scripts/ab_grouped.py (the grouped MoE path's host mechanisms side by side, a device experiment) runs on the CPU at
tiny sizes, and its variants, the device-built index tensors included, give the library's outputs and gradients
(the script asserts it)."""
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")


def test_the_variants_agree_on_the_cpu(capsys):
    path = Path(__file__).resolve().parent.parent / "scripts" / "ab_grouped.py"
    spec = importlib.util.spec_from_file_location("ab_grouped", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--experts", "40", "--hidden", "64", "--inter", "32", "--tokens", "64", "--top-k", "4",
                     "--rank", "4", "--iters", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert all(f"{v} (" in out for v in ("loop16", "host16", "host16_sync", "device16", "host_all", "all")), out
