"""Loading into the MMA layout (what a GPU with the kernel gets), exercised on the CPU.

`kernels.storage_format` picks NVFP4's MMA layout only where the CUDA kernel runs; here it is
told the kernel is available, so the loader repacks layer by layer while the matmuls take the
torch path (which reads the layout back through `to_checkpoint`). References: the same model
loaded in the standard layout, and the checkpoint files themselves.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_tiny

from qerl.checkpoint import save_adapter
from qerl.checkpoint.compressed_tensors import save_compressed
from qerl.formats.nvfp4_mma import NVFP4Mma
from qerl.kernels import w4_mma
from qerl.layers import group_of
from qerl.layers.fused_group import QKV
from qerl.model import load_policy, quantized_layers

FIX = Path(__file__).parent / "fixtures" / "lc_tiny_llama" / "nvfp4a16"


@pytest.fixture
def mma_here(monkeypatch):
    monkeypatch.setattr(w4_mma, "available", lambda device: True)


def _load(path, **kw):
    kw.setdefault("dtype", torch.float32)
    return load_policy(str(path), "auto", lora_rank=8, progress=False, **kw)


def _randomize_lora(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, layer in quantized_layers(model):
            layer.lora_A.weight.copy_(torch.randn(layer.lora_A.weight.shape, generator=g) * 0.1)
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.1)


def test_loader_repacks_and_checkpoint_round_trips_byte_identical(mma_here, tmp_path):
    pol = _load(FIX, dtype=torch.bfloat16)  # the checkpoint's own dtype, so every tensor can match
    layers = dict(quantized_layers(pol.model))
    assert layers and all(isinstance(m.fmt, NVFP4Mma) for m in layers.values())
    g = group_of(pol.model.model.layers[0].self_attn, QKV)
    assert g is not None and isinstance(g.fmt, NVFP4Mma)  # the group's one weight is in the layout too
    out = save_compressed(pol, tmp_path / "out")
    a, b = load_file(FIX / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)), k


def test_mma_layout_model_computes_what_the_standard_one_does(monkeypatch, tmp_path):
    std = _load(FIX)
    monkeypatch.setattr(w4_mma, "available", lambda device: True)
    mma = _load(FIX)
    for pol in (std, mma):
        _randomize_lora(pol.model)
    ids = torch.randint(0, std.config.vocab_size, (2, 11))
    with torch.no_grad():
        a, b = std.model(ids).logits, mma.model(ids).logits
    assert torch.equal(a, b)
    save_adapter(std, tmp_path / "a")
    save_adapter(mma, tmp_path / "b")
    x, y = load_file(tmp_path / "a" / "adapter_model.safetensors"), load_file(tmp_path / "b" / "adapter_model.safetensors")
    assert set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_dense_checkpoint_quantizes_into_the_layout(mma_here, tmp_path):
    save_tiny(tmp_path / "dense", "qwen2")
    pol = load_policy(str(tmp_path / "dense"), "nvfp4", lora_rank=4, progress=False, dtype=torch.float32)
    ref = load_policy(str(tmp_path / "dense"), "nvfp4", lora_rank=4, progress=False, dtype=torch.float32,
                      fuse_groups=False)
    for (n, m), (_, r) in zip(quantized_layers(pol.model), quantized_layers(ref.model)):
        assert isinstance(m.fmt, NVFP4Mma), n
        got = m.fmt.to_checkpoint(m.quant_tensors(), m.weight_shape)
        want = r.fmt.to_checkpoint(r.quant_tensors(), r.weight_shape)
        for k in want:
            assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), (n, k)
