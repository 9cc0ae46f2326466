"""NVFP4 stored in humming's layout on the GPU (KernelSettings.humming_storage: one copy of each weight).

References: humming's own layer built by its `transform()` from the compressed-tensors bytes (the stored
tensors come from qerl's pure-torch repack instead: the two must be the same bytes, so the same kernel gives
the same bits), NVFP4's dequantize of those bytes for the backward, and a model in qerl's MMA layout (where
humming serves routed M from a second copy)."""

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
humming = pytest.importorskip("humming")

from qerl.formats import NVFP4  # noqa: E402
from qerl.formats.nvfp4_humming import NVFP4Humming  # noqa: E402
from qerl.kernels import dispatch, humming_backend, lora_shrink, routes, settings  # noqa: E402
from qerl.kernels.humming_backend import HummingWeight  # noqa: E402
from qerl.kernels.humming_ksplit import KSplitWeight  # noqa: E402
from qerl.model import qwen25_config, quantized_layers, random_policy  # noqa: E402
from qerl.rollout import Engine, SamplingParams  # noqa: E402


def _ct(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * torch.rand(n, 1, device="cuda", generator=g) * 0.05
    return NVFP4().quantize(w.to(torch.bfloat16))


@pytest.mark.parametrize("n,k", [(4608, 3584), (512, 256), (3584, 18944)])
def test_stored_tensors_give_humming_layer_bits_at_every_m(n, k):
    ct = _ct(n, k, n + k)
    ref = HummingWeight.build("nvfp4", {a: t.clone() for a, t in ct.items()}, (n, k))
    fmt = NVFP4Humming()
    h = fmt.from_checkpoint(ct, (n, k))
    assert torch.equal(h["weight_packed"], ref.layer.weight) and torch.equal(
        h["weight_scale"].view(torch.uint8), ref.layer.weight_scale.view(torch.uint8))
    for m in (1, 5, 16, 64, 256, 2048):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        # the mode the stored path runs at this M (routes.json's stored lists: 3584x18944 is humming_nosplit up to
        # M 64 on the H100), which HummingWeight runs the same way; a split-K route through KSplitWeight
        mode = routes.pick(m, x.device, (n, k), stored=True)
        want = (KSplitWeight.build({a: t.clone() for a, t in ct.items()}, (n, k), routes.KSPLIT[mode]).matmul(x)
                if mode in routes.KSPLIT else ref.matmul(x, backend=mode))
        assert torch.equal(humming_backend.stored_matmul(x, fmt, h, (n, k)), want), (m, mode)


def test_lora_bias_and_the_backward_from_the_stored_bytes():
    n, k, r = 4608, 3584, 32
    ct = _ct(n, k, 7)
    fmt = NVFP4Humming()
    h = fmt.from_checkpoint(ct, (n, k))
    ref = HummingWeight.build("nvfp4", {a: t.clone() for a, t in ct.items()}, (n, k))
    a = torch.randn(3 * r, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, r, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for m in (1, 64, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        lo = dispatch.LoraTerm(None, b, 2.0, (3584, 4096), a=a)
        got = humming_backend.stored_matmul(x, fmt, h, (n, k), bias=bias, lora=lo)
        # against the mode the stored path runs at this M (the H100's stored list: humming_ksplit4 to M 256)
        mode = routes.pick(m, x.device, (n, k), stored=True)
        same = (KSplitWeight.build({a: t.clone() for a, t in ct.items()}, (n, k), routes.KSPLIT[mode])
                if mode in routes.KSPLIT else ref)
        want = same.matmul(x, bias=bias, lora=lora_shrink.shrunk(lo, x), backend=mode)
        assert torch.equal(got, want), m
    gy = torch.randn(300, n, device="cuda", dtype=torch.bfloat16)
    w = NVFP4().dequantize(ct, (n, k), torch.bfloat16)
    assert torch.equal(humming_backend.stored_matmul_grad_input(gy, fmt, h, (n, k)), gy @ w)


def _policy(humming_storage):
    torch.manual_seed(0)  # LoRA A's initialization draws from the global generator: the same factors in each build
    with settings.use(humming_storage=humming_storage):
        pol = random_policy(qwen25_config("qwen2.5-0.5b", 4), "nvfp4", lora_rank=16, device="cuda", std=0.05,
                            progress=False)
    for nm, p in pol.model.named_parameters():
        if "lora_B" in nm:
            torch.nn.init.normal_(p, generator=torch.Generator(device="cuda").manual_seed(len(nm)), std=0.05)
    return pol


def test_a_model_in_the_layout_keeps_one_copy_and_agrees_with_the_mma_layout():
    one = _policy(True)
    layers = dict(quantized_layers(one.model))
    assert sum(isinstance(m.fmt, NVFP4Humming) for m in layers.values()) >= len(layers) // 2
    ids = torch.randint(0, one.config.vocab_size, (4, 64), device="cuda")
    with torch.no_grad():  # libraries' workspaces (cuBLAS, humming's configs and locks) exist after one call
        one.model(ids[:1, :8])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        y1 = one.model(ids).logits.float()
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated() - before - y1.numel() * 4  # the fp32 logits kept
    weights = sum(t.numel() * t.element_size() for m in layers.values() for t in m.quant_tensors().values())
    assert grown < 0.05 * weights, (grown, weights)  # no second copy of any weight was made
    two = _policy(False)
    with torch.no_grad():
        y2 = two.model(ids).logits.float()
        with settings.use(kernels=False):  # the plain-torch path: dequantize + cuBLAS
            ref = two.model(ids).logits.float()
    # the same weights through other bf16 kernels: the stored path is as close to the plain-torch reference as the
    # MMA layout's kernels are (H100 at ff722d0: every layer within 0.002 relative; the logits of 4 random layers
    # amplify that to ~0.03, so a fixed bound on y1 - y2 says little)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(y1, ref) < max(2 * rel(y2, ref), 5e-3), (rel(y1, ref), rel(y2, ref), rel(y1, y2))
    # a training step's gradients flow through the stored bytes
    loss = one.model(ids).logits.float().square().mean()
    loss.backward()
    grads = [m.lora_A.weight.grad for m in layers.values()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_graphs_equal_eager_and_seeded_sampling_repeats(overlap):
    """Also with KernelSettings.lora_overlap (the LoRA shrink on a side stream beside humming's GEMM, which every
    stored weight runs): its GPU test before it may become the default."""
    pol = _policy(True)
    ks = dataclasses.replace(settings.current(), lora_overlap=overlap)
    prompts = [list(range(100, 100 + L)) for L in (7, 30, 64)]
    greedy = SamplingParams(max_new_tokens=32, greedy=True, ignore_eos=True)
    a = Engine(pol.model, max_len=160, max_slots=24, sync_every=8, kernel_settings=ks).generate(prompts, n=6,
                                                                                                params=greedy)
    b = Engine(pol.model, max_len=160, max_slots=24, cuda_graphs=False, kernel_settings=ks).generate(
        prompts, n=6, params=greedy)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    p = SamplingParams(max_new_tokens=32, temperature=1.0, seed=0, ignore_eos=True)
    eng = Engine(pol.model, max_len=160, max_slots=24, kernel_settings=ks)
    c1, c2 = eng.generate(prompts, n=4, params=p), eng.generate(prompts, n=4, params=p)
    assert [c.token_ids for c in c1] == [c.token_ids for c in c2]
