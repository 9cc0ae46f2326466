"""NVFP4 stored in humming's layout (formats/nvfp4_humming.py, KernelSettings.humming_storage), on the CPU.

The layout's bytes are checked against a literal emulation of humming's repack in test_humming_layout.py and
against humming itself in test_humming_layout_gpu.py; here: the format round-trips the checkpoint bytes, its
dequantize equals NVFP4's, a fused group splits its storage along the layout's row dim, and a whole model
loaded into the layout (the torch path reads it back) computes what the standard layout computes, with the
checkpoint written back byte for byte. References: NVFP4 itself and the same model in the standard layout."""

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_tiny

from qerl.checkpoint.compressed_tensors import save_compressed
from qerl.formats import NVFP4, get_format
from qerl.formats.base import NonFiniteWeightError
from qerl.formats.nvfp4_humming import NVFP4Humming
from qerl.kernels import settings, storage_format
from qerl.layers import QLoRALinear, group_of
from qerl.layers.fused_group import GATE_UP, QKV, QuantGroup, row_split
from qerl.model import load_policy, quantized_layers


def _ct(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.05
    return NVFP4().quantize(w.to(torch.bfloat16)), w


@pytest.mark.parametrize("n,k", [(128, 32), (256, 96), (384, 512)])
def test_format_round_trips_the_checkpoint_and_dequantizes_as_nvfp4(n, k):
    ct, w = _ct(n, k, n + k)
    fmt = NVFP4Humming()
    h = fmt.from_checkpoint(ct, (n, k))
    want = fmt.expected_shapes((n, k))
    assert set(h) == set(want) and all(tuple(h[a].shape) == s and h[a].dtype == d for a, (s, d) in want.items())
    back = fmt.to_checkpoint(h, (n, k))
    for key in ct:
        assert torch.equal(back[key].view(torch.uint8), ct[key].view(torch.uint8)), key
    assert torch.equal(h["weight_scale_2"], 1 / ct["weight_global_scale"])
    for dt in (torch.float32, torch.bfloat16):
        assert torch.equal(fmt.dequantize(h, (n, k), dt), NVFP4().dequantize(ct, (n, k), dt))
    q = fmt.quantize(w.to(torch.bfloat16))
    assert all(torch.equal(q[a].view(torch.uint8), h[a].view(torch.uint8)) for a in h)


def test_bad_input_is_refused_with_the_layer_named():
    ct, _ = _ct(128, 64, 0)
    with pytest.raises(ValueError, match="layers.0.q_proj"):
        NVFP4Humming().from_checkpoint(ct, (96, 128), "layers.0.q_proj")
    bad = dict(ct, weight_global_scale=torch.tensor([float("nan")]))
    with pytest.raises(ValueError, match="layers.0.q_proj"):
        NVFP4Humming().from_checkpoint(bad, (128, 64), "layers.0.q_proj")
    nan_scale = dict(ct, weight_scale=ct["weight_scale"].clone())
    nan_scale["weight_scale"].view(torch.uint8)[3, 1] = 0x7F  # e4m3 NaN
    with pytest.raises(NonFiniteWeightError, match="layers.0.q_proj.weight_scale"):
        NVFP4Humming().from_checkpoint(nan_scale, (128, 64), "layers.0.q_proj")


def test_storage_format_picks_the_layout_only_when_asked_and_the_shape_fits():
    nv = get_format("nvfp4")
    assert storage_format(nv, (256, 128), "cpu") is nv
    with settings.use(humming_storage=True):
        assert isinstance(storage_format(nv, (256, 128), "cpu"), NVFP4Humming)
        assert storage_format(nv, (192, 128), "cpu") is nv  # humming's sm_90 tiles want rows % 128
        assert storage_format(nv, (256, 48), "cpu") is nv  # inputs % 32
        mx = get_format("mxfp4")
        assert storage_format(mx, (256, 128), "cpu") is mx


def test_row_split_follows_the_layout_row_dim():
    split = row_split(NVFP4Humming(), [256, 128, 128], 64)
    assert split == {"weight_packed": (1, [512, 256, 256]), "weight_scale": (1, [256, 128, 128]),
                     "weight_global_scale": None, "weight_scale_2": None}
    assert "tiles of 64" in row_split(NVFP4Humming(), [256, 96], 64)
    assert row_split(NVFP4(), [32, 16], 64)["weight_packed"] == (0, [32, 16])


def test_a_fused_group_in_the_layout_equals_the_standard_group():
    rows, k, r = (256, 128, 128), 128, 4
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(n, k, generator=g).mul_(0.05) for n in rows]
    gs = NVFP4().global_scale(ws)

    def build(fmt):
        ms = [QLoRALinear.from_weight(w, fmt, global_scale=gs, r=r, dtype=torch.float32) for w in ws]
        gen = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for m in ms:
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=gen) * 0.1)
                m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=gen) * 0.1)
        return ms, QuantGroup(ms)

    (std, gstd), (hum, ghum) = build(NVFP4()), build(NVFP4Humming())
    assert ghum.shares_storage() and ghum.tensors["weight_packed"].is_contiguous()
    for a, b in zip(std, hum):  # each member's column view holds its own checkpoint bytes
        assert not b.weight_packed.is_contiguous()
        ca, cb = a.checkpoint_tensors(), b.checkpoint_tensors()
        assert all(torch.equal(ca[key].view(torch.uint8), cb[key].view(torch.uint8)) for key in ca)
    x = torch.randn(5, k, generator=g)
    with torch.no_grad():
        assert all(torch.equal(p, q) for p, q in zip(gstd(x), ghum(x)))
    outs = []
    for grp in (gstd, ghum):
        xg = x.clone().requires_grad_()
        sum((y * (i + 1)).sum() for i, y in enumerate(grp(xg))).backward()
        outs.append(xg.grad)
    assert torch.equal(*outs)
    for a, b in zip(std, hum):  # members one by one (the reference path) read their views too
        assert torch.equal(a(x), b(x))


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dense128")
    save_tiny(d, "qwen2", hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)
    return d


def _load(path, quant, humming, **kw):
    with settings.use(humming_storage=humming):
        return load_policy(str(path), quant, lora_rank=8, progress=False, dtype=torch.float32, **kw)


def test_a_model_in_the_layout_computes_what_the_standard_one_does(dense_dir, tmp_path):
    std, hum = _load(dense_dir, "nvfp4", False), _load(dense_dir, "nvfp4", True)
    layers = dict(quantized_layers(hum.model))
    assert layers and all(isinstance(m.fmt, NVFP4Humming) for m in layers.values())
    assert hum.repack_seconds > 0 and std.repack_seconds == 0  # the load's repack is timed
    for attrs in (QKV, GATE_UP):
        parent = hum.model.model.layers[0].self_attn if attrs is QKV else hum.model.model.layers[0].mlp
        assert isinstance(group_of(parent, attrs).fmt, NVFP4Humming)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for (_, a), (_, b) in zip(quantized_layers(std.model), quantized_layers(hum.model)):
            for p, q in ((a.lora_A.weight, b.lora_A.weight), (a.lora_B.weight, b.lora_B.weight)):
                v = torch.randn(p.shape, generator=g) * 0.1
                p.copy_(v)
                q.copy_(v)
    ids = torch.randint(0, std.config.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        assert torch.equal(std.model(ids).logits, hum.model(ids).logits)
    la, lb = std.model(ids).logits.square().mean(), hum.model(ids).logits.square().mean()
    la.backward()
    lb.backward()
    for (n, a), (_, b) in zip(quantized_layers(std.model), quantized_layers(hum.model)):
        assert torch.equal(a.lora_A.weight.grad, b.lora_A.weight.grad), n
    # the checkpoint written from the layout is the one written from the standard layout, byte for byte
    oa, ob = save_compressed(std, tmp_path / "a"), save_compressed(hum, tmp_path / "b")
    x, y = load_file(oa / "model.safetensors"), load_file(ob / "model.safetensors")
    assert set(x) == set(y)
    assert all(torch.equal(x[k].contiguous().view(torch.uint8), y[k].contiguous().view(torch.uint8)) for k in x)
