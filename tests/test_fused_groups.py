"""Fused q|k|v and gate|up groups: one storage, members as views, one matmul per group on rollouts.

References are independent of the group code: compressed-tensors' own compressor
(tests/reference_ct.py), llm-compressor's files (tests/fixtures/lc_tiny_llama), the same
model loaded with fuse_groups=False, and the members' own forwards.
"""

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from reference_ct import ct_compress, ct_decompress, ct_global_scale
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny

from qerl.checkpoint import load_adapter, save_adapter
from qerl.checkpoint.compressed_tensors import save_compressed
from qerl.formats import get_format
from qerl.kernels import dispatch
from qerl.layers import QLoRALinear, fused_groups, group_of
from qerl.layers.fused_group import GATE_UP, QKV, fuse, why_not_fusable
from qerl.model import load_policy, quantized_layers
from qerl.rollout import Engine, SamplingParams

FIX = Path(__file__).parent / "fixtures" / "lc_tiny_llama"
GROUPS = (("self_attn", QKV), ("mlp", GATE_UP))


def policy(path, quant="nvfp4", rank=8, **kw):
    kw.setdefault("dtype", torch.float32)
    return load_policy(str(path), quant, lora_rank=rank, progress=False, **kw)


def groups_of(model):
    """{(layer, parent name): group} for every decoder layer; fails if one is missing."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for parent, attrs in GROUPS:
            g = group_of(getattr(layer, parent), attrs)
            assert g is not None, f"layer {i} {parent} is not fused"
            out[i, parent] = g
    return out


def randomize_lora(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in quantized_layers(model):
            layer.lora_A.weight.copy_(torch.randn(layer.lora_A.weight.shape, generator=g) * 0.1)
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.1)


def u8(t):
    return t.contiguous().view(torch.uint8)


def same_storage(a, b):
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.fixture(params=["qwen2", "llama"])  # qwen2: q/k/v carry biases
def base(request, tmp_path):
    save_tiny(tmp_path / "base", request.param)
    return tmp_path / "base"


# ---- storage ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_group_storage_is_the_per_projection_quantization(base, fmt):
    """Byte-equal to compressed-tensors compressing each member alone (NVFP4: with the group's shared
    global scale, as llm-compressor does), rows in member order; members' tensors are views of it."""
    pol = policy(base, fmt)
    dense = load_file(base / "model.safetensors")
    for (i, parent), g in groups_of(pol.model).items():
        names = [f"model.layers.{i}.{parent}.{a}" for a in (QKV if parent == "self_attn" else GATE_UP)]
        ws = [dense[f"{n}.weight"] for n in names]
        gs = ct_global_scale(ws) if fmt == "nvfp4" else None
        ref = [ct_compress(w, fmt, gs) for w in ws]
        for key, t in g.tensors.items():
            want = ref[0][key] if key == "weight_global_scale" else torch.cat([r[key] for r in ref])
            assert t.dtype == want.dtype and torch.equal(u8(t), u8(want)), (names, key)
            for m in g.members:
                assert same_storage(getattr(m, key), t), (names, key)
        if f"{names[0]}.bias" in dense:
            assert torch.equal(g.bias, torch.cat([dense[f"{n}.bias"] for n in names]).float())
            assert all(same_storage(m.bias, g.bias) for m in g.members)
        else:
            assert g.bias is None
        for s, m in enumerate(g.members):
            assert same_storage(m.lora_A.weight, g.A_cat) and same_storage(m.lora_B.weight, g.B_cat)
            assert torch.equal(m.lora_A.weight, g.A_cat[s * 8:(s + 1) * 8])
            assert torch.equal(m.lora_B.weight, g.B_cat[g.bounds[s]:g.bounds[s + 1]])
            assert m.lora_A.weight.requires_grad and m.lora_B.weight.requires_grad


def test_group_storage_equals_llmcompressor_files():
    """Quantizing the fixture's bf16 model gives, per group, llm-compressor's member tensors stacked."""
    pol = load_policy(str(FIX / "bf16"), "nvfp4", lora_rank=0, progress=False)
    files = load_file(FIX / "nvfp4a16" / "model.safetensors")
    for (i, parent), g in groups_of(pol.model).items():
        names = [f"model.layers.{i}.{parent}.{a}" for a in (QKV if parent == "self_attn" else GATE_UP)]
        assert torch.equal(u8(g.tensors["weight_packed"]), torch.cat([files[f"{n}.weight_packed"] for n in names]))
        assert torch.equal(u8(g.tensors["weight_scale"]), torch.cat([u8(files[f"{n}.weight_scale"]) for n in names]))
        assert torch.equal(g.tensors["weight_global_scale"], files[f"{names[0]}.weight_global_scale"])


def test_optimizer_step_on_a_member_is_what_the_group_reads(base):
    pol = policy(base)
    g = groups_of(pol.model)[0, "self_attn"]
    k = g.members[1]
    params = [k.lora_A.weight, k.lora_B.weight]
    for p in params:
        p.grad = torch.ones_like(p)
    before = g.A_cat.clone(), g.B_cat.clone()
    torch.optim.AdamW(params, lr=0.1).step()
    r, (b0, b1) = k.r, g.bounds[1:3]
    assert not torch.equal(g.A_cat[r:2 * r], before[0][r:2 * r]) and torch.equal(g.A_cat[r:2 * r], k.lora_A.weight)
    assert torch.equal(g.B_cat[b0:b1], k.lora_B.weight) and not torch.equal(g.B_cat[b0:b1], before[1][b0:b1])
    assert torch.equal(g.A_cat[:r], before[0][:r])  # q's rows untouched
    assert g.shares_storage()


# ---- forward ---------------------------------------------------------------------------------------


def _reference(m, x):
    """x·Wᵀ + b + scaling·(x·Aᵀ)·Bᵀ in float64, W the member's own dequantized weight (which is
    compressed-tensors' decompression of its checkpoint tensors, to bf16)."""
    w = m.dequantized_weight(torch.float64)
    assert torch.equal(w.to(torch.bfloat16), ct_decompress(m.checkpoint_tensors(), m.fmt.name, torch.bfloat16))
    y = F.linear(x.double(), w, None if m.bias is None else m.bias.double())
    if m.r and not m.disable_adapters:
        y = y + m.scaling * F.linear(F.linear(x.double(), m.lora_A.weight.double()), m.lora_B.weight.double())
    return y


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_group_forward_equals_the_members(base, fmt):
    pol = policy(base, fmt)
    randomize_lora(pol.model)
    x = torch.randn(2, 5, pol.config.hidden_size)
    for g in groups_of(pol.model).values():
        with torch.no_grad():
            outs = g(x)
            for m, y in zip(g.members, outs):
                torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(y.double(), _reference(m, x), rtol=1e-5, atol=1e-5)


def _spy_shapes(monkeypatch) -> list:
    """Record the weight shape of every base matmul (a fused call has the group's shape)."""
    calls, real = [], dispatch.base_matmul

    def spy(x, fmt, tensors, shape, *a, **kw):
        calls.append(tuple(shape))
        return real(x, fmt, tensors, shape, *a, **kw)

    monkeypatch.setattr(dispatch, "base_matmul", spy)
    return calls


def test_group_forward_falls_back_where_it_must(base, monkeypatch):
    pol = policy(base, lora_dropout=0.5)
    randomize_lora(pol.model)
    g = groups_of(pol.model)[1, "self_attn"]
    x = torch.randn(3, pol.config.hidden_size)
    calls = _spy_shapes(monkeypatch)

    def check(expect_fused):
        calls.clear()
        torch.manual_seed(5)
        with torch.no_grad():
            outs = g(x)
        torch.manual_seed(5)
        with torch.no_grad():
            refs = [m(x) for m in g.members]
        for y, r in zip(outs, refs):
            torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-5)
        assert (calls[0] == g.shape) == expect_fused, calls

    check(True)  # eval mode: dropout is the identity
    g.members[1].disable_adapters = True
    check(False)  # mixed adapter states: member by member
    for m in g.members:
        m.disable_adapters = True
    check(True)  # the base policy: one base matmul
    for m in g.members:
        m.disable_adapters = False
    pol.model.train()
    check(False)  # training-mode dropout draws a mask per member
    pol.model.eval()
    with torch.enable_grad():
        ys = g(x)
    assert all(y.grad_fn is not None for y in ys)  # autograd: the members' own path
    g.members[0].lora_A.weight.data = g.members[0].lora_A.weight.data.clone()  # rebinding breaks the sharing
    with pytest.warns(UserWarning, match="no longer shares storage"):
        check(False)


def test_rank_zero_group_forward(base):
    pol = policy(base, rank=0)
    g = groups_of(pol.model)[0, "mlp"]
    assert g.A_cat is None
    x = torch.randn(2, 4, pol.config.hidden_size)
    with torch.no_grad():
        for m, y in zip(g.members, g(x)):
            torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)


def test_engine_greedy_is_unchanged_by_fusing(base, monkeypatch):
    torch.manual_seed(3)
    fused = policy(base, rank=4)
    torch.manual_seed(3)
    plain = policy(base, rank=4, fuse_groups=False)
    assert list(fused_groups(fused.model)) and not list(fused_groups(plain.model))
    for p in (fused, plain):
        randomize_lora(p.model)
    prompts = [[5, 6, 7, 8], [10, 11], list(range(20, 40))]
    sp = SamplingParams(max_new_tokens=24, greedy=True, ignore_eos=True)
    b = Engine(plain.model, max_len=64, max_slots=4).generate(prompts, n=2, params=sp)
    calls = _spy_shapes(monkeypatch)
    a = Engine(fused.model, max_len=64, max_slots=4).generate(prompts, n=2, params=sp)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    cfg = fused.config
    h, inter = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * h // cfg.num_attention_heads
    assert (h + 2 * kv, h) in calls and (2 * inter, h) in calls  # prefill and decode ran the groups
    assert (kv, h) not in calls  # never k_proj alone


# ---- formats -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant,double_quant,fused", [("bf16", True, True), ("nf4", False, True), ("nf4", True, False)])
def test_other_formats_group_only_when_exact(base, quant, double_quant, fused):
    pol = policy(base, quant, nf4_double_quant=double_quant)
    if not fused:  # NF4's double quantization is over the whole tensor: not separable by rows
        assert not list(fused_groups(pol.model))
        return
    randomize_lora(pol.model)
    dense = load_file(base / "model.safetensors")
    fmt = get_format(quant, double_quant=double_quant)
    x = torch.randn(3, pol.config.hidden_size)
    for (i, parent), g in groups_of(pol.model).items():
        names = [f"model.layers.{i}.{parent}.{a}" for a in (QKV if parent == "self_attn" else GATE_UP)]
        ref = [fmt.quantize(dense[f"{n}.weight"]) for n in names]
        for key, t in g.tensors.items():
            assert torch.equal(u8(t), torch.cat([u8(r[key]) for r in ref])), key
        with torch.no_grad():
            for m, y in zip(g.members, g(x)):
                torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)


def test_nf4_rows_that_straddle_a_block_stay_separate():
    fmt = get_format("nf4", double_quant=False)
    members = [QLoRALinear(64, n, fmt, dtype=torch.float32) for n in (3, 5)]  # each member whole blocks
    assert why_not_fusable(members) is None
    members = [QLoRALinear(32, n, fmt, dtype=torch.float32) for n in (3, 5)]  # 96 inputs: blocks straddle
    assert "straddle" in why_not_fusable(members)


def test_a_bf16_fallback_member_leaves_its_group_separate(tmp_path):
    save_tiny(tmp_path / "m", "qwen2")
    # one member kept in bf16 (a NaN weight used to do it; that is refused now: test_nonfinite_weights.py)
    pol = policy(tmp_path / "m", modules_to_not_convert=["layers.0.self_attn.k_proj"])
    attn = pol.model.model.layers[0].self_attn
    assert attn.k_proj.fmt.name == "bf16" and group_of(attn, QKV) is None
    assert group_of(pol.model.model.layers[0].mlp, GATE_UP) is not None
    assert group_of(pol.model.model.layers[1].self_attn, QKV) is not None
    assert torch.equal(attn.q_proj.weight_global_scale, attn.v_proj.weight_global_scale)


def test_mma_layout_rows_slice_into_members():
    """A kernel layout that keeps 16-row tiles contiguous: the group's tensors, sliced by rows, are the
    members' tensors in that layout, and the checkpoint bytes are the standard ones."""
    mma = pytest.importorskip("qerl.formats.nvfp4_mma")
    torch.manual_seed(0)
    std, fmt = get_format("nvfp4"), mma.NVFP4Mma()
    ws = [torch.randn(n, 64) * 0.05 for n in (64, 32, 32)]
    gs = std.global_scale(ws)
    parent = torch.nn.Module()
    for a, w in zip(QKV, ws):
        setattr(parent, a, QLoRALinear.from_weight(w, fmt, torch.randn(w.shape[0]), global_scale=gs, r=4,
                                                   dtype=torch.float32))
        torch.nn.init.normal_(getattr(parent, a).lora_B.weight, std=0.1)
    g = fuse(parent, QKV)
    assert g is not None and group_of(parent, QKV) is g
    want = fmt.from_checkpoint({k: torch.cat([std.quantize(w, gs)[k] for w in ws]) if k != "weight_global_scale"
                                else gs for k in ("weight_packed", "weight_scale", "weight_global_scale")}, g.shape)
    for k, t in g.tensors.items():
        assert torch.equal(u8(t), u8(want[k])), k
    x = torch.randn(2, 64)
    with torch.no_grad():
        for a, w, y in zip(QKV, ws, g(x)):
            m = getattr(parent, a)
            torch.testing.assert_close(y, m(x), rtol=1e-5, atol=1e-5)
            ck = m.checkpoint_tensors()
            assert all(torch.equal(u8(ck[k]), u8(v)) for k, v in std.quantize(w, gs).items())


# ---- checkpoints -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_llmcompressor_checkpoint_round_trips_byte_identical(tmp_path, fmt):
    src = FIX / f"{fmt}a16"
    pol = load_policy(str(src), "auto", lora_rank=8, progress=False)
    assert len(groups_of(pol.model)) == 2 * pol.config.num_hidden_layers
    out = save_compressed(pol, tmp_path / "out")
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(u8(a[k]), u8(b[k])), k


def test_checkpoint_with_unshared_global_scales_loads_unfused(tmp_path):
    """A compressed-tensors file whose q/k/v do not share a global scale: no group there, no error."""
    src = tmp_path / "ct"
    shutil.copytree(FIX / "nvfp4a16", src)
    sd = load_file(src / "model.safetensors")
    key = "model.layers.0.self_attn.k_proj.weight_global_scale"
    sd[key] = sd[key] * 2
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    pol = load_policy(str(src), "auto", lora_rank=4, progress=False)
    layers = pol.model.model.layers
    assert group_of(layers[0].self_attn, QKV) is None and group_of(layers[1].self_attn, QKV) is not None
    out = load_file(save_compressed(pol, tmp_path / "out") / "model.safetensors")
    assert all(torch.equal(u8(sd[k]), u8(out[k])) for k in sd)


def test_peft_adapter_loads_in_place_and_saves_the_same_files(base, tmp_path):
    pol = policy(base, lora_alpha=32)
    randomize_lora(pol.model)
    ad = save_adapter(pol, tmp_path / "ad")
    plain = policy(base, lora_alpha=32, fuse_groups=False)
    randomize_lora(plain.model)
    ref = save_adapter(plain, tmp_path / "plain")
    a, b = load_file(ad / "adapter_model.safetensors"), load_file(ref / "adapter_model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (ad / "adapter_config.json").read_text() == (ref / "adapter_config.json").read_text()

    fresh = policy(base)  # same rank: the adapter is copied into the existing views
    before = {n: (p, p.data_ptr()) for n, p in fresh.model.named_parameters() if ".lora_" in n}
    load_adapter(fresh, ad)
    after = dict(fresh.model.named_parameters())
    assert all(after[n] is p and p.data_ptr() == ptr for n, (p, ptr) in before.items())
    for g in groups_of(fresh.model).values():
        assert g.shares_storage()
        assert torch.equal(g.A_cat, torch.cat([a[f"base_model.model.{n}.lora_A.weight"]
                                               for n in g.names]))


def test_peft_adapter_into_a_rank_zero_grouped_model_reattaches(base, tmp_path):
    pol = policy(base)
    randomize_lora(pol.model)
    ad = save_adapter(pol, tmp_path / "ad")
    bare = policy(base, rank=0)
    load_adapter(bare, ad)
    x = torch.randint(0, 160, (2, 9))
    for g in groups_of(bare.model).values():
        assert g.A_cat is not None and g.shares_storage()
        assert all(same_storage(m.lora_A.weight, g.A_cat) for m in g.members)
    h = torch.randn(3, bare.config.hidden_size)
    with torch.no_grad():
        for g in groups_of(bare.model).values():
            for m, y in zip(g.members, g(h)):
                torch.testing.assert_close(y, m(h), rtol=1e-5, atol=1e-5)
        assert torch.equal(bare.model(x).logits, pol.model(x).logits)
