"""A base weight holding NaN or inf is refused at load, by layer and tensor (issue 50: it loaded with one
warning, generated nothing and passed the parity gate)."""

import pytest
import torch

from qerl.formats import get_format
from qerl.formats.base import NonFiniteWeightError, first_nonfinite
from qerl.layers.qlora_linear import QLoRALinear


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_layer_refuses_quantized_tensors_of_a_nonfinite_weight(fmt, bad):
    w = torch.randn(32, 64)
    w[5, 17] = bad
    t = get_format(fmt).quantize(w)
    layer = QLoRALinear(64, 32, get_format(fmt))
    with pytest.raises(NonFiniteWeightError, match=r"model\.layers\.3\.mlp\.down_proj\.\w+ holds NaN or inf"):
        layer.load_quantized(t, "model.layers.3.mlp.down_proj")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_finite_weights_load_and_report_nothing(fmt):
    t = get_format(fmt).quantize(torch.randn(32, 64))
    assert first_nonfinite(t) is None
    QLoRALinear(64, 32, get_format(fmt)).load_quantized(t, "w")


def test_the_first_bad_position_is_named():
    scale = torch.ones(4, 4, dtype=torch.float8_e4m3fn)
    scale[2, 1] = float("nan")
    assert first_nonfinite({"weight_packed": torch.zeros(4, 2, dtype=torch.uint8), "weight_scale": scale,
                            "weight_global_scale": torch.ones(1)}) == ("weight_scale", (2, 1))
    e8m0 = torch.full((4, 2), 127, dtype=torch.uint8)
    e8m0[3, 0] = 255  # E8M0's NaN
    assert first_nonfinite({"weight_packed": torch.zeros(4, 2, dtype=torch.uint8), "weight_scale": e8m0}) == \
        ("weight_scale", (3, 0))
