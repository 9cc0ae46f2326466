"""The quantized LoRA layer against an explicit dequantize-then-matmul reference and PEFT."""

import pytest
import torch
from torch import nn

from qerl.formats import get_format
from qerl.layers import QLoRALinear

FORMATS = ["nvfp4", "mxfp4", "nf4", "bf16"]


def make_layer(fmt, out=48, inp=128, r=8, alpha=16, bias=True, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    b = torch.randn(out, generator=g) * 0.1 if bias else None
    layer = QLoRALinear.from_weight(w, fmt, b, r=r, lora_alpha=alpha, dtype=dtype)
    with torch.no_grad():  # non-zero B so that every gradient path is exercised
        layer.lora_B.weight.normal_(0, 0.1, generator=g)
    return layer


@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_and_grads_match_explicit_reference(fmt):
    layer = make_layer(fmt)
    x = torch.randn(3, 5, 128, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    # Reference: dequantize once, then plain float64 autograd.
    W = get_format(fmt).dequantize(layer.quant_tensors(), (48, 128), torch.float64)
    A = layer.lora_A.weight.detach().clone().requires_grad_()
    B = layer.lora_B.weight.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    yr = xr @ W.t() + layer.bias + layer.scaling * (xr @ A.t()) @ B.t()
    torch.testing.assert_close(y, yr, rtol=1e-12, atol=1e-12)
    gy = torch.randn_like(y)
    y.backward(gy)
    yr.backward(gy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.lora_A.weight.grad, A.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(layer.lora_B.weight.grad, B.grad, rtol=1e-12, atol=1e-12)
    # The frozen parts get no gradient and hold no dense copy of the weight.
    assert layer.bias.grad is None
    assert all(not t.requires_grad for t in layer.quant_tensors().values())
    if fmt != "bf16":
        assert all(t.element_size() == 1 or t.numel() < 48 * 128 / 16 for t in layer.quant_tensors().values())


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_gradcheck(fmt):
    layer = make_layer(fmt, out=20, inp=64, r=4)
    x = torch.randn(2, 64, dtype=torch.float64, requires_grad=True)
    A = layer.lora_A.weight.detach().clone().requires_grad_()
    B = layer.lora_B.weight.detach().clone().requires_grad_()

    def f(x, A, B):
        return torch.func.functional_call(layer, {"lora_A.weight": A, "lora_B.weight": B}, (x,))

    assert torch.autograd.gradcheck(f, (x, A, B))


def test_lora_grads_equal_peft_on_bf16_linear():
    """Same weights in PEFT's LoRA on an nn.Linear: identical outputs and LoRA grads."""
    from peft import LoraConfig, get_peft_model

    layer = make_layer("nvfp4", r=8, alpha=32, bias=False, dtype=torch.float32)

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(128, 48, bias=False)

        def forward(self, x):
            return self.proj(x)

    ref = Wrap()
    ref.proj.weight.data = layer.dequantized_weight(torch.float32)
    peft_model = get_peft_model(ref, LoraConfig(r=8, lora_alpha=32, target_modules=["proj"]))
    lp = peft_model.base_model.model.proj
    lp.lora_A["default"].weight.data.copy_(layer.lora_A.weight.data)
    lp.lora_B["default"].weight.data.copy_(layer.lora_B.weight.data)
    x = torch.randn(4, 128)
    gy = torch.randn(4, 48)
    layer(x).backward(gy)
    y = peft_model(x)
    y.backward(gy)
    torch.testing.assert_close(layer(x), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.lora_A.weight.grad, lp.lora_A["default"].weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.lora_B.weight.grad, lp.lora_B["default"].weight.grad, rtol=1e-5, atol=1e-6)


def test_lora_init_is_a_noop_and_adapters_can_be_disabled():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 64, generator=g)
    layer = QLoRALinear.from_weight(w, "nvfp4", r=4, lora_alpha=8, dtype=torch.float32)
    assert layer.lora_B.weight.abs().sum() == 0 and layer.lora_A.weight.abs().sum() > 0
    x = torch.randn(2, 64)
    base = x @ layer.dequantized_weight(torch.float32).t()
    torch.testing.assert_close(layer(x), base)
    layer.lora_B.weight.data.fill_(0.5)
    assert not torch.allclose(layer(x), base)
    layer.disable_adapters = True
    torch.testing.assert_close(layer(x), base)


def test_dropout_applies_to_lora_path_only():
    layer = make_layer("nvfp4", r=4, alpha=4, bias=False, dtype=torch.float32)
    layer.add_lora(4, 4, dropout=0.5, dtype=torch.float32)
    layer.lora_B.weight.data.normal_()
    x = torch.randn(64, 128)
    layer.eval()
    y_eval = layer(x)
    layer.train()
    torch.manual_seed(0)
    y_train = layer(x)
    assert not torch.allclose(y_eval, y_train)
    layer.lora_B.weight.data.zero_()
    torch.testing.assert_close(layer(x), x @ layer.dequantized_weight(torch.float32).t())


def test_load_quantized_rejects_wrong_shape():
    layer = QLoRALinear(64, 32, "nvfp4")
    t = get_format("nvfp4").quantize(torch.randn(32, 64))
    t["weight_scale"] = t["weight_scale"][:, :2]
    with pytest.raises(ValueError, match=r"q_proj.weight_scale: expected"):
        layer.load_quantized(t, "q_proj")
