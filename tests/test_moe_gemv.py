"""The grouped 4-bit MoE decode GEMV (kernels/moe_gemv.py) against a float64 reference (each chosen
expert dequantized by the format's own function, then a matmul), and QuantExperts with the switch on
against the switch off. On the CPU the kernel runs in Triton's interpreter at tiny sizes with fp32/fp16
activations (its bf16 is broken); outputs are poisoned with NaN first, so an unwritten row fails."""

import dataclasses
import os

import pytest
import torch

triton = pytest.importorskip("triton")
from qerl.formats import get_format  # noqa: E402
from qerl.kernels import moe_gemv, settings  # noqa: E402
from qerl.layers.quant_experts import QuantExperts, quantize_experts  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and not in the Triton interpreter", allow_module_level=True)
ACT = [torch.bfloat16, torch.float16] if CUDA else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1e-2}

# top_k_index [T, k] over E experts: experts hit by 0, 1 and several tokens; top-1; "no expert" (= E) pairs.
ROUTES = {
    "mixed": (6, [[3, 1], [3, 5], [2, 3], [3, 5], [5, 2]]),  # counts 0, 1, 2, 4, 0, 3
    "top1": (4, [[2]]),
    "top3_with_none": (4, [[0, 4, 2], [2, 0, 4], [4, 4, 4]]),
}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not CUDA:
        monkeypatch.setattr(moe_gemv, "RUN_ON_CPU_INTERPRETER", True)


def _experts(fmt, e, n, k, seed):
    """E random experts quantized one by one and stacked, as QuantExperts.quantize stores them."""
    g = torch.Generator().manual_seed(seed)
    f = get_format(fmt)
    per = []
    for _ in range(e):
        w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1).to(DEV, torch.bfloat16)
        per.append(f.quantize(w, f.global_scale([w]) if f.has_global_scale else None))
    return f, {key: torch.stack([t[key] for t in per]) for key in per[0]}


def _ref(f, t, shape, x, idx, e):
    """[T, k, N] float64: x_t·W_eᵀ per (token, slot), NaN where the slot is the "no expert" index."""
    out = torch.full((*idx.shape, shape[0]), float("nan"), dtype=torch.float64)
    for ex in range(e):
        tok, pos = torch.where(idx.cpu() == ex)
        if len(tok):
            w = f.dequantize({key: v[ex] for key, v in t.items()}, shape, torch.float64).cpu()
            out[tok, pos] = x.cpu().double()[tok] @ w.t()
    return out


def _run(f, t, shape, x, idx, e, tiles=None):
    """The kernel's output mapped back to [T, k, N] (rows of "no expert" pairs stay NaN)."""
    rt = moe_gemv.route(idx, e)
    y = torch.full((idx.numel(), shape[0]), float("nan"), device=x.device, dtype=x.dtype)
    moe_gemv.grouped_gemv(x, rt.token, rt, f, t, shape, out=y, tiles=tiles)
    got = torch.full((idx.numel(), shape[0]), float("nan"), dtype=torch.float64)
    got[rt.order.cpu()] = y.double().cpu()
    return got.view(*idx.shape, shape[0])


def _check(got, want, tol):
    none = torch.isnan(want)
    assert torch.equal(torch.isnan(got), none), "a chosen pair's row was not written, or a 'no expert' row was"
    g, w = got[~none], want[~none]
    assert ((g - w).norm() / w.norm()).item() < tol


@pytest.mark.parametrize("fmt,n,k", [("nvfp4", 40, 48), ("nvfp4", 70, 160), ("mxfp4", 40, 96), ("mxfp4", 70, 160)])
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("dtype", ACT)
@pytest.mark.parametrize("x_mode", [0, 1, 2] if CUDA else [0])  # the ways of reading x (the GPU decode's alone)
def test_grouped_gemv_matches_float64(fmt, n, k, route, dtype, x_mode):
    """N off the 64-row block, K off the 64/128 K tile (a multiple of the format's block, as it must be)."""
    e, idx = ROUTES[route]
    idx = torch.tensor(idx, device=DEV)
    f, t = _experts(fmt, e, n, k, seed=n + k + e)
    x = torch.randn(idx.shape[0], k, device=DEV).to(dtype)
    tiles = dataclasses.replace(moe_gemv.default_tiles(idx.numel(), e), x_mode=x_mode)
    _check(_run(f, t, (n, k), x, idx, e, tiles), _ref(f, t, (n, k), x, idx, e), TOL[dtype])


@pytest.mark.parametrize("tiles", [moe_gemv.Tiles(block_m=16), moe_gemv.Tiles(block_m=16, block_n=32, block_k=32,
                                                                              num_warps=2, num_stages=2)])
def test_an_expert_with_more_tokens_than_a_block_loops_over_them(tiles):
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.zeros(20, dtype=torch.long), torch.randint(1, 3, (20,), generator=g)], 1).to(DEV)
    f, t = _experts("nvfp4", 3, 40, 96, seed=5)  # expert 0: all 20 tokens, two chunks of 16
    x = torch.randn(20, 96, device=DEV)
    dtype = torch.bfloat16 if CUDA else torch.float32
    want = _ref(f, t, (40, 96), x.to(dtype), idx, 3)
    _check(_run(f, t, (40, 96), x.to(dtype), idx, 3, tiles), want, TOL[dtype])


def test_the_token_tile_follows_pairs_per_expert_not_tokens():
    """64 tokens top-8 of 128 experts: ~4 pairs an expert, so a 16-token tile (a 64 one loaded 16x the x it
    used); many pairs on few experts get a larger tile, capped at BLOCK_M."""
    assert moe_gemv.default_tiles(64 * 8, 128).block_m == 16
    assert moe_gemv.default_tiles(1 * 8, 128).block_m == 16
    assert moe_gemv.default_tiles(256 * 8, 128).block_m == 32
    assert moe_gemv.default_tiles(64 * 4, 32).block_m == 16  # gpt-oss-20b shape: 8 pairs an expert
    assert moe_gemv.default_tiles(128 * 4, 32).block_m == 32  # 16 pairs an expert
    assert moe_gemv.default_tiles(10_000, 4).block_m == moe_gemv.BLOCK_M


def test_route_sorts_pairs_by_expert_and_pads_slots():
    rt = moe_gemv.route(torch.tensor([[3, 1], [3, 5], [2, 3], [3, 5], [5, 2]]), 6)
    assert rt.slot_expert.tolist() == [1, 2, 3, 5, 0, 4]  # hit ascending, then unhit (padding, no tokens)
    assert rt.slot_count.tolist() == [1, 2, 4, 3, 0, 0]
    assert rt.slot_start.tolist()[:4] == [0, 1, 3, 7]
    assert rt.ends.tolist() == [1, 3, 7, 10, 10, 10, 10]
    assert rt.expert.tolist() == sorted(rt.expert.tolist()) and rt.valid.all() and rt.tokens == 5
    rt = moe_gemv.route(torch.tensor([[0, 4]], dtype=torch.int32), 4)  # E = 4: "no expert"; int32 indices
    assert rt.valid.tolist() == [True, False] and rt.expert.tolist() == [0, 3] and rt.ends.tolist() == [1, 1, 2]


def test_refuses_what_it_cannot_read():
    f = get_format("mxfp4")
    t = {"weight_packed": torch.zeros(2, 8, 24, dtype=torch.uint8, device=DEV),  # K = 48: not a multiple of 32
         "weight_scale": torch.zeros(2, 8, 1, dtype=torch.uint8, device=DEV)}
    rt = moe_gemv.route(torch.tensor([[0]], device=DEV), 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        moe_gemv.grouped_gemv(torch.zeros(1, 48, device=DEV), rt.token, rt, f, t, (8, 48))
    x = torch.zeros(4, 64, device=DEV)
    assert moe_gemv.supports(x, get_format("nvfp4")) and moe_gemv.supports(x, f)
    assert not moe_gemv.supports(x, get_format("nf4"))
    assert not moe_gemv.supports(torch.zeros(moe_gemv.MAX_TOKENS + 1, 64, device=DEV), f)  # prefill: not decode
    assert not moe_gemv.supports(torch.zeros(0, 64, device=DEV), f)  # no tokens: nothing to launch


def _glu(y):
    g, u = y.chunk(2, -1)
    return torch.nn.functional.silu(g) * u


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quant_experts_switch_on_equals_off(fmt, monkeypatch):
    """LoRA, biases and the "no expert" index, on a bare QuantExperts (MXFP4: gpt-oss's stock experts)."""
    g = torch.Generator().manual_seed(7)
    e, h, i = 5, 64, 32
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) * 0.1, torch.randn(e, h, i, generator=g) * 0.1
    biases = {"gate_up_proj": torch.randn(e, 2 * i, generator=g) * 0.1,
              "down_proj": torch.randn(e, h, generator=g) * 0.1}
    q = QuantExperts.quantize(gate_up, down, fmt, _glu, torch.float32, biases=biases).to(DEV)
    q.add_lora(4, 8.0, torch.float32)
    with torch.no_grad():
        for p in q.lora_B.values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(6, h, generator=g).to(DEV)
    idx = torch.tensor([[0, 3], [3, 5], [4, 0], [3, 1], [5, 5], [0, 3]], device=DEV)  # 5 = E: no expert
    wts = torch.rand(6, 2, generator=g).to(DEV)
    calls = _count_calls(monkeypatch)
    with torch.no_grad():
        with settings.use(moe_gemv=False):  # the loop: the reference
            want = q(x, idx, wts)
        with settings.use(moe_gemv=True):
            got = q(x, idx, wts)
    assert calls == [2] and torch.allclose(got, want, atol=1e-5)


def _count_calls(monkeypatch):
    calls = [0]
    real = moe_gemv.grouped_gemv

    def counted(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(moe_gemv, "grouped_gemv", counted)
    return calls


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_model_logits_with_the_switch_on_equal_off(family, monkeypatch):
    """Whole tiny models (Qwen3-MoE; gpt-oss: transposed experts, biases, clamped interleaved gating), LoRA on
    the experts; and with autograd on the switch is ignored (the kernel has no backward)."""
    from test_moe_experts import add_random_expert_lora, tiny_moe
    from test_moe_grouped import IDS

    m = tiny_moe(family).to(DEV)
    quantize_experts(m, "nvfp4")
    add_random_expert_lora(m)
    ids = IDS[:1].to(DEV)
    calls = _count_calls(monkeypatch)
    with torch.no_grad():
        with settings.use(moe_gemv=False):
            want = m(ids).logits
        with settings.use(moe_gemv=True):
            got = m(ids).logits
    assert calls == [4]  # 2 layers x 2 projections
    assert torch.allclose(got, want, atol=1e-5)
    with settings.use(moe_gemv=True):
        m(ids)
    assert calls == [4]
