"""Training through the fused q|k|v and gate|up groups (fused_group._GroupTrainMatmul): one base matmul,
one shrink and one base grad-input per group, the gradients on the members' own LoRA parameters.

References are independent of the group code: the same model loaded with fuse_groups=False (each
projection its own layer and storage), and for one group an explicit float64 dequantize-then-matmul
computation under plain autograd. fp32 on the CPU, 1e-5 relative.
"""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import save_tiny
from torch import nn

from qerl.formats import get_format
from qerl.kernels import dispatch
from qerl.layers import QLoRALinear, group_of, unfused_lora
from qerl.layers.fused_group import GATE_UP, QKV, fuse, members_one_by_one
from qerl.model import load_policy, quantized_layers
from qerl.train.logprobs import completion_logprobs, pad_batch

GROUPS = (("self_attn", QKV), ("mlp", GATE_UP))


@pytest.fixture(scope="module", params=["qwen2", "llama"])  # qwen2: q/k/v carry biases
def base(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(path, request.param)
    return path


def policy(path, quant="nvfp4", fuse_groups=True, **kw):
    return load_policy(str(path), quant, lora_rank=8, progress=False, dtype=torch.float32, fuse_groups=fuse_groups,
                       **kw)


def pair(path, quant="nvfp4", **kw):
    """The model with its groups, and the same weights and adapters without groups (the reference)."""
    fused, plain = policy(path, quant, **kw), policy(path, quant, fuse_groups=False, **kw)
    assert group_of(fused.model.model.layers[0].self_attn, QKV) is not None
    assert group_of(plain.model.model.layers[0].self_attn, QKV) is None
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for (n, a), (n2, b) in zip(quantized_layers(fused.model), quantized_layers(plain.model)):
            assert n == n2
            for pa, pb in ((a.lora_A.weight, b.lora_A.weight), (a.lora_B.weight, b.lora_B.weight)):
                v = torch.randn(pa.shape, generator=g) * 0.1  # B != 0: every gradient path is exercised
                pa.copy_(v)
                pb.copy_(v)
    return fused.model, plain.model


def groups(model):
    return [group_of(getattr(layer, parent), attrs) for layer in model.model.layers for parent, attrs in GROUPS]


def key(g):
    """How `spy` records a call on the group's storage (shapes alone may coincide: q|k|v's and gate's)."""
    return tuple(g.shape), id(g.tensors)


def spy(monkeypatch):
    """(weight shape, id of the tensors dict) of every base matmul and base grad-input call."""
    calls = {"fwd": [], "bwd": []}
    fwd, bwd = dispatch.base_matmul, dispatch.base_matmul_grad_input

    def f(x, fmt, tensors, shape, *a, **kw):
        calls["fwd"].append((tuple(shape), id(tensors)))
        return fwd(x, fmt, tensors, shape, *a, **kw)

    def b(gy, fmt, tensors, shape):
        calls["bwd"].append((tuple(shape), id(tensors)))
        return bwd(gy, fmt, tensors, shape)

    monkeypatch.setattr(dispatch, "base_matmul", f)
    monkeypatch.setattr(dispatch, "base_matmul_grad_input", b)
    return calls


def loss_and_grads(model, ids, seed=0):
    """A loss over every position, and the gradients of it w.r.t. the LoRA parameters and the input
    embeddings."""
    model.zero_grad()
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    torch.manual_seed(seed)
    logits = model(inputs_embeds=emb).logits
    loss = (logits.log_softmax(-1)[..., 3] * torch.linspace(-1, 1, logits.shape[1])).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, emb.grad


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_same_training(fused, plain, ids, fused_ran=True, calls=None):
    lf, gf, ef = loss_and_grads(fused, ids)
    if calls is not None:
        keys = {key(g) for g in groups(fused)}
        assert bool(keys & set(calls["fwd"])) == fused_ran and bool(keys & set(calls["bwd"])) == fused_ran, calls
        calls["fwd"].clear()
        calls["bwd"].clear()
    lp, gp, ep = loss_and_grads(plain, ids)
    assert rel(lf, lp) < 1e-5
    assert gf.keys() == gp.keys() and any(".lora_A" in n for n in gf)
    for n in gp:
        assert rel(gf[n], gp[n]) < 1e-5, (n, rel(gf[n], gp[n]))
    assert rel(ef, ep) < 1e-5


IDS = torch.randint(0, 160, (2, 11), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("quant", ["nvfp4", "bf16", "mxfp4"])
def test_training_through_the_groups_equals_the_unfused_model(base, quant, monkeypatch):
    fused, plain = pair(base, quant)
    calls = spy(monkeypatch)
    assert_same_training(fused, plain, IDS, calls=calls)
    with members_one_by_one():  # the switch for A/B measurements is the member path
        assert_same_training(fused, plain, IDS, fused_ran=False, calls=calls)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_the_group(base, reentrant, monkeypatch):
    fused, plain = pair(base)
    for m in (fused, plain):
        kw = {"use_reentrant": reentrant}
        if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.2x; the old name warns
            m.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        m.train()  # transformers checkpoints in training mode only (dropout is the identity here)
    calls = spy(monkeypatch)
    n_layers = len(fused.model.layers)
    assert_same_training(fused, plain, IDS, calls=calls)
    calls["fwd"].clear()
    loss_and_grads(fused, IDS)
    # the trainer's non-reentrant checkpoint: the group forward, then again in backward's recompute; the
    # reentrant one runs its first forward without grad (the members' rollout path), then recomputes
    for g in groups(fused):
        assert calls["fwd"].count(key(g)) == (1 if reentrant else 2) and calls["bwd"].count(key(g)) == 1


def test_one_base_matmul_and_one_grad_input_per_group(monkeypatch):
    """Through one group on its own, and through a decoder layer (attention and MLP call their
    members one by one): per group one base matmul forward and one base grad-input backward."""
    torch.manual_seed(0)
    parent = nn.Module()
    ws = [torch.randn(n, 64) * 0.05 for n in (64, 32, 32)]
    gs = get_format("nvfp4").global_scale(ws)  # members of a group share one
    for a, w in zip(QKV, ws):
        setattr(parent, a, QLoRALinear.from_weight(w, "nvfp4", global_scale=gs, r=4, dtype=torch.float32))
    g = fuse(parent, QKV)
    assert g is not None
    x = torch.randn(2, 5, 64, requires_grad=True)
    calls = spy(monkeypatch)
    ys = [getattr(parent, a)(x) for a in QKV]  # as the model calls them
    sum(y.square().sum() for y in ys).backward()
    assert calls == {"fwd": [key(g)], "bwd": [key(g)]}
    assert all(getattr(parent, a).lora_A.weight.grad is not None for a in QKV)


def test_decoder_layer_calls_each_group_once(base, monkeypatch):
    fused, _ = pair(base)
    calls = spy(monkeypatch)
    loss_and_grads(fused, IDS)
    gs = groups(fused)
    for g in gs:
        assert calls["fwd"].count(key(g)) == 1 and calls["bwd"].count(key(g)) == 1
    members = {(m.weight_shape, id(g.tensors)) for g in gs for m in g.members}
    cfg = fused.config
    others = {(cfg.hidden_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)}  # o_proj, down_proj
    for shape, _ in set(calls["fwd"] + calls["bwd"]) - {key(g) for g in gs}:
        assert shape in others, shape  # never a member alone
    assert not members & set(calls["fwd"])


def _reference_group(members, x):
    """Each member as x·Wᵀ + b + scaling·(x·Aᵀ)·Bᵀ in float64 with its own dequantized W, under plain
    autograd on copies of the adapters."""
    leaves, ys = [], []
    for m in members:
        w = m.dequantized_weight(torch.float64)
        a = m.lora_A.weight.detach().double().requires_grad_()
        b = m.lora_B.weight.detach().double().requires_grad_()
        leaves += [a, b]
        y = F.linear(x, w, None if m.bias is None else m.bias.double())
        ys.append(y + m.scaling * F.linear(F.linear(x, a), b))
    return ys, leaves


@pytest.mark.parametrize("fmt", ["nvfp4", "nf4"])
def test_group_training_equals_an_explicit_float64_reference(fmt, monkeypatch):
    g0 = torch.Generator().manual_seed(0)
    parent = nn.Module()
    fm = get_format(fmt, double_quant=False) if fmt == "nf4" else get_format(fmt)
    ws = [torch.randn(n, 128, generator=g0) * 0.05 for n in (64, 32, 32)]
    gs = fm.global_scale(ws) if fm.has_global_scale else None  # one global scale: the group's
    for a, w in zip(QKV, ws):
        n = w.shape[0]
        layer = QLoRALinear.from_weight(w, fm, torch.randn(n, generator=g0) * 0.1, global_scale=gs, r=4,
                                        lora_alpha=8, dtype=torch.float64)
        with torch.no_grad():
            layer.lora_B.weight.normal_(0, 0.1, generator=g0)
        setattr(parent, a, layer)
    g = fuse(parent, QKV)
    assert g is not None
    x = torch.randn(3, 4, 128, dtype=torch.float64, generator=g0, requires_grad=True)
    calls = spy(monkeypatch)
    ys = g(x)  # the group called directly (the rollout engine's `project`)
    assert calls["fwd"] == [key(g)]
    xr = x.detach().clone().requires_grad_()
    refs, leaves = _reference_group(g.members, xr)
    gys = [torch.randn(y.shape, dtype=torch.float64, generator=g0) for y in ys]
    for y, r in zip(ys, refs):
        torch.testing.assert_close(y, r, rtol=1e-12, atol=1e-12)
    torch.autograd.backward(ys, gys)
    torch.autograd.backward(refs, gys)
    assert calls["bwd"] == [key(g)]
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-12, atol=1e-12)
    for i, m in enumerate(g.members):
        torch.testing.assert_close(m.lora_A.weight.grad, leaves[2 * i].grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m.lora_B.weight.grad, leaves[2 * i + 1].grad, rtol=1e-12, atol=1e-12)
        assert m.bias.grad is None
    # a second backward accumulates into the members' .grad, as the member path does
    a0 = g.members[1].lora_A.weight.grad.clone()
    sum((y * gy).sum() for y, gy in zip(g(x), gys)).backward()
    torch.testing.assert_close(g.members[1].lora_A.weight.grad, 2 * a0, rtol=1e-12, atol=1e-12)


# ---- fallbacks: member by member, the same numbers ----------------------------------------------------


def test_training_mode_dropout_runs_member_by_member(base, monkeypatch):
    fused, plain = pair(base, lora_dropout=0.3)
    fused.train(), plain.train()
    calls = spy(monkeypatch)
    assert_same_training(fused, plain, IDS, fused_ran=False, calls=calls)  # the same masks, member by member
    fused.eval(), plain.eval()
    assert_same_training(fused, plain, IDS, fused_ran=True, calls=calls)  # eval: dropout is the identity


def fused_counts(model, calls):
    """Per group (layer 0's attention and MLP, layer 1's): how many base matmuls (forward) and
    grad-inputs ran on its storage during a training pass of `model`."""
    calls["fwd"].clear()
    calls["bwd"].clear()
    loss_and_grads(model, IDS)
    return [(calls["fwd"].count(key(g)), calls["bwd"].count(key(g))) for g in groups(model)]


def test_a_member_with_its_adapter_disabled_runs_member_by_member(base, monkeypatch):
    fused, plain = pair(base)
    calls = spy(monkeypatch)
    assert fused_counts(fused, calls) == [(1, 1)] * 4
    for m in (fused, plain):
        m.model.layers[1].self_attn.k_proj.disable_adapters = True
        m.model.layers[0].mlp.up_proj.disable_adapters = True
    assert fused_counts(fused, calls) == [(1, 1), (0, 0), (0, 0), (1, 1)]  # those two member by member
    assert_same_training(fused, plain, IDS)
    # every q|k|v member disabled (the base policy, the KL reference): one base matmul per group
    for m in (fused, plain):
        for layer in m.model.layers:
            for a in QKV:
                getattr(layer.self_attn, a).disable_adapters = True
    assert fused_counts(fused, calls) == [(1, 1), (0, 0), (1, 1), (1, 1)]
    assert_same_training(fused, plain, IDS)
    calls["fwd"].clear()
    with torch.no_grad(), unfused_lora():
        fused(IDS)
    assert calls["fwd"].count(key(groups(fused)[2])) == 1


def test_trainable_bias_differing_scalings_and_unshared_storage_run_member_by_member(tmp_path, monkeypatch):
    save_tiny(tmp_path, "qwen2")
    fused, plain = pair(tmp_path)
    calls = spy(monkeypatch)
    for m in (fused, plain):  # a trainable bias: its gradient comes from the member path
        m.model.layers[0].self_attn.v_proj.bias.requires_grad_(True)
    assert fused_counts(fused, calls) == [(0, 0), (1, 1), (1, 1), (1, 1)]
    assert_same_training(fused, plain, IDS)
    for m in (fused, plain):
        m.model.layers[0].self_attn.v_proj.bias.requires_grad_(False)
        m.model.layers[0].mlp.up_proj.scaling = 3.0
    assert fused_counts(fused, calls) == [(1, 1), (0, 0), (1, 1), (1, 1)]
    assert_same_training(fused, plain, IDS)
    k = fused.model.layers[1].self_attn.k_proj
    k.lora_B.weight = nn.Parameter(k.lora_B.weight.detach().clone())  # rebound: no longer the group's view
    with pytest.warns(UserWarning, match="no longer shares storage"):
        assert fused_counts(fused, calls) == [(1, 1), (0, 0), (0, 0), (1, 1)]
    assert_same_training(fused, plain, IDS)


def test_kept_outputs_are_not_reused_after_a_change():
    """A member's kept columns serve only a call on the same, unchanged input under the same adapters."""
    torch.manual_seed(0)
    parent = nn.Module()
    ws = [torch.randn(32, 64) * 0.05 for _ in GATE_UP]
    for a, w in zip(GATE_UP, ws):
        setattr(parent, a, QLoRALinear.from_weight(w, "nvfp4", global_scale=get_format("nvfp4").global_scale(ws), r=4,
                                                   dtype=torch.float32))
        nn.init.normal_(getattr(parent, a).lora_B.weight, std=0.1)
    assert fuse(parent, GATE_UP) is not None
    gate, up = parent.gate_proj, parent.up_proj
    x = torch.randn(3, 64)

    def alone(m, x):
        with members_one_by_one():
            return m(x)

    gate(x)
    x.add_(1.0)  # in place: the kept `up` columns are stale
    torch.testing.assert_close(up(x), alone(up, x), rtol=1e-5, atol=1e-6)
    gate(x)
    with torch.no_grad():
        up.lora_A.weight.mul_(2.0)  # an optimizer step between the calls
    torch.testing.assert_close(up(x), alone(up, x), rtol=1e-5, atol=1e-6)
    gate(x)
    torch.testing.assert_close(up(x.clone()), alone(up, x), rtol=1e-5, atol=1e-6)  # another tensor: the group again
    torch.testing.assert_close(up(x), alone(up, x), rtol=1e-5, atol=1e-6)  # and twice the same member


# ---- unfused_lora: the no-grad pass gives the grad pass's numbers bit for bit ----------------------------


@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_unfused_lora_no_grad_logprobs_equal_the_grad_pass_bit_for_bit(base, quant, monkeypatch):
    """PPO's old policy (no grad, unfused_lora) against the policy being differentiated at step 0: the
    same computation, so the ratio is exactly 1. Both take the groups' training path."""
    fused, _ = pair(base, quant)
    batch = pad_batch([[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15, 16, 17, 18]])
    calls = spy(monkeypatch)
    with torch.no_grad(), unfused_lora():
        old, old_ent = completion_logprobs(fused, *batch, chunk=3)
    with unfused_lora():
        new, new_ent = completion_logprobs(fused, *batch, chunk=3)
    assert all(calls["fwd"].count(key(g)) == 2 for g in groups(fused))
    assert new.requires_grad and torch.equal(old, new) and torch.equal(old_ent, new_ent)
    with torch.no_grad():  # the rollout-style kernels (LoRA in the epilogue): other roundings allowed
        fast, _ = completion_logprobs(fused, *batch, chunk=3)
    torch.testing.assert_close(fast, old, rtol=1e-5, atol=1e-5)


def test_adapters_in_another_dtype_than_the_activations():
    """bf16 weights and activations with fp32 adapters: the expand is cast as on the member path."""
    torch.manual_seed(0)
    ws = [torch.randn(n, 64) * 0.05 for n in (64, 32, 32)]
    gs = get_format("nvfp4").global_scale(ws)
    parent = nn.Module()
    for a, w in zip(QKV, ws):
        layer = QLoRALinear.from_weight(w, "nvfp4", global_scale=gs, dtype=torch.bfloat16)
        layer.add_lora(4, 8, dtype=torch.float32)
        nn.init.normal_(layer.lora_B.weight, std=0.1)
        setattr(parent, a, layer)
    g = fuse(parent, QKV)
    assert g is not None and g.A_cat.dtype == torch.float32
    x = torch.randn(6, 64, dtype=torch.bfloat16)

    def run():
        ys = [getattr(parent, a)(x) for a in QKV]
        sum((y.float() * torch.linspace(-1, 1, y.shape[-1])).sum() for y in ys).backward()
        out = [y.detach() for y in ys], [p.grad.clone() for p in parent.parameters() if p.grad is not None]
        parent.zero_grad()
        return out

    yf, gf = run()
    with members_one_by_one():
        ym, gm = run()
    for a, b in zip(yf, ym):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b)
    assert len(gf) == len(gm) == 6
    for a, b in zip(gf, gm):
        assert a.dtype == torch.float32 and rel(a, b) < 1e-5


def test_unfused_lora_under_inference_mode(base):
    """Inference tensors have no version counter: each member's call runs the group (nothing kept)."""
    fused, _ = pair(base)
    with torch.no_grad(), unfused_lora():
        want = fused(IDS).logits
    with torch.inference_mode(), unfused_lora():
        got = fused(IDS).logits
    assert torch.equal(got, want)
