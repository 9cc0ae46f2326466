"""Interop with files the real llm-compressor (0.14, oneshot NVFP4A16 / MXFP4A16) wrote.

The fixture (tests/fixtures/make_lc_fixture.py) is a tiny Llama with an all-zero
group, an outlier and q/k/v of different amax, so block-scale edge cases and the
fused global scale are exercised.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qerl.layers import QLoRALinear
from qerl.model import load_policy

FIX = Path(__file__).parent / "fixtures" / "lc_tiny_llama"
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
KEYS = {"nvfp4": ["weight_packed", "weight_scale", "weight_global_scale"], "mxfp4": ["weight_packed", "weight_scale"]}


def _layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QLoRALinear)}


def _assert_bytes_equal(model, fmt, files):
    layers = _layers(model)
    assert len(layers) == 2 * len(PROJ)
    for i in range(2):
        for p in PROJ:
            name = f"model.layers.{i}.{p}"
            layer = layers[name]
            assert layer.fmt.name == fmt, name
            for k in KEYS[fmt]:
                ours, theirs = getattr(layer, k), files[f"{name}.{k}"]
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, f"{name}.{k}"
                assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)), f"{name}.{k} differs"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_load_llmcompressor_checkpoint_directly(fmt):
    folder = FIX / f"{fmt}a16"
    policy = load_policy(str(folder), "auto", lora_rank=8, progress=False)
    assert policy.quant == fmt
    _assert_bytes_equal(policy.model, fmt, load_file(folder / "model.safetensors"))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantizing_bf16_reproduces_llmcompressor_bytes_and_logits(fmt):
    ours = load_policy(str(FIX / "bf16"), fmt, lora_rank=0, progress=False)
    _assert_bytes_equal(ours.model, fmt, load_file(FIX / f"{fmt}a16" / "model.safetensors"))
    theirs = load_policy(str(FIX / f"{fmt}a16"), "auto", lora_rank=0, progress=False)
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        a, b = ours.model(ids).logits, theirs.model(ids).logits
    assert torch.equal(a, b)
    # And the quantized model is a faithful (not identical) copy of the bf16 one.
    dense = load_policy(str(FIX / "bf16"), "bf16", lora_rank=0, progress=False)
    with torch.no_grad():
        ref = dense.model(ids).logits.float()
    rel = (a.float() - ref).norm() / ref.norm()
    assert 1e-4 < rel < 0.2, rel


def test_fixture_has_the_edge_cases():
    w = load_file(FIX / "bf16" / "model.safetensors")
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert torch.all(q[5, 16:32] == 0)
    nv = load_file(FIX / "nvfp4a16" / "model.safetensors")
    gs = [nv[f"model.layers.0.self_attn.{p}_proj.weight_global_scale"] for p in "qkv"]
    assert torch.equal(gs[0], gs[1]) and torch.equal(gs[1], gs[2])  # fused group shares one global scale
