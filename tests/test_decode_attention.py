"""Decode attention (split-KV, GQA-grouped), the fused rotary + KV write, and the FP8 KV cache.

The Triton kernels run in the interpreter on the CPU (fp32) and natively on the GPU (bf16, FP8);
each is checked against an independent torch computation: full-matrix softmax attention with K/V
expanded to every query head, and HF's rotate-half rotary."""

import os

import pytest
import torch

from qerl.rollout import attention, rope_kv
from qerl.rollout.kv_cache import FP8_MAX, KVCache, _quantize, dequantize

CUDA = torch.cuda.is_available()
INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def naive_attention(q, k_cache, v_cache, lengths, scaling):
    """Per slot, per query head: softmax(q·K^T) V over its first lengths[i] keys, K/V expanded."""
    s, h, d = q.shape
    r = h // k_cache.shape[1]
    out = torch.empty(s, h, d, dtype=torch.float64)
    for i in range(s):
        n = int(lengths[i])
        for j in range(h):
            k = k_cache[i, j // r, :n].double()
            v = v_cache[i, j // r, :n].double()
            p = torch.softmax((k @ q[i, j].double()) * scaling, 0)
            out[i, j] = p @ v
    return out


@pytest.fixture
def interp(monkeypatch):
    if not CUDA:
        if not INTERP:
            pytest.skip("needs TRITON_INTERPRET=1 on the CPU")
        monkeypatch.setattr(attention, "RUN_ON_CPU_INTERPRETER", True)
    return torch.device("cuda" if CUDA else "cpu")


@pytest.mark.parametrize("n_slots,h,n_kv,d,lengths", [
    (3, 6, 2, 32, [1, 130, 257]),  # GQA r=3, one slot with a single key, lengths across splits
    (2, 4, 4, 16, [64, 5]),  # MHA
    (1, 7, 1, 64, [300]),  # r=7 as Qwen2.5-7B, one KV head
])
def test_split_kv_attention_matches_naive(interp, n_slots, h, n_kv, d, lengths):
    torch.manual_seed(1)
    dt = torch.bfloat16 if CUDA else torch.float32
    cap = 320
    q = torch.randn(n_slots, h, d, device=interp).to(dt)
    kc = torch.randn(n_slots + 2, n_kv, cap, d, device=interp).to(dt)  # more slots than the batch
    vc = torch.randn(n_slots + 2, n_kv, cap, d, device=interp).to(dt)
    lens = torch.tensor(lengths, device=interp)
    for n_keys in (max(lengths), cap):  # the static bound changes the split count, not the result
        got = attention.decode_attention(q, kc, vc, lens, n_keys, 0.3)
        want = naive_attention(q.cpu(), kc.cpu(), vc.cpu(), lens.cpu(), 0.3)
        tol = 2e-2 if dt == torch.bfloat16 else 1e-5
        assert (got.cpu().double() - want).abs().max() < tol
        ref = attention.reference(q, kc, vc, lens, n_keys, 0.3)  # the CPU path agrees too
        assert (ref.cpu().double() - want).abs().max() < tol


def test_split_count_fills_the_gpu_and_respects_minimum():
    assert attention.n_splits(1, 4, 1280, 132) == 10  # 1280 keys / 128 per split caps it
    assert attention.n_splits(1, 4, 8192, 132) == 64  # ceil(2*132/4) = 66 > 64 = 8192/128
    assert attention.n_splits(64, 4, 8192, 132) == 2
    assert attention.n_splits(256, 8, 8192, 132) == 1
    assert attention.n_splits(1, 4, 100, 132) == 1


def test_fp8_cache_roundtrip_and_saturation():
    x = torch.tensor([[[0.5, -1.0], [100.0, 3.0]]])  # [Hkv=1, T=2, d=2]
    scale = torch.tensor([1.0 / 4])  # 448 * 1/4 = 112 representable
    q = _quantize(x, scale)
    assert q.dtype == torch.float8_e4m3fn
    back = dequantize(q[None], scale[None], torch.float32)[0]
    rel = ((back - x).abs() / x.abs()).max()
    assert rel <= 2**-4  # E4M3: 3 mantissa bits, round to nearest
    big = _quantize(torch.tensor([[[1e6]]]), scale)
    assert float(big.float()[0, 0, 0]) == FP8_MAX  # saturates, never inf/nan


class _View:
    def __init__(self, dev, n_kv=2, d=16, layers=1):
        self.n_layers, self.n_kv, self.head_dim, self.device, self.dtype = layers, n_kv, d, dev, torch.float32


def test_fp8_cache_prefix_scale_and_token_write():
    torch.manual_seed(0)
    c = KVCache(_View(torch.device("cpu")), n_slots=3, max_len=8, kv_dtype="fp8")
    k = torch.randn(2, 5, 16)
    v = torch.randn(2, 5, 16) * 10
    c.write_prefix(0, [0, 2], k, v, 5)
    ks, vs = c.k_scale[0], c.v_scale[0]
    assert torch.allclose(ks[2], k.abs().amax(dim=(1, 2)) * 4.0 / FP8_MAX)
    assert torch.allclose(vs[0], v.abs().amax(dim=(1, 2)) * 4.0 / FP8_MAX)
    deq = dequantize(c.k[0][2:3, :, :5], ks[2:3], torch.float32)[0]
    assert ((deq - k).abs() <= k.abs() * 2**-4 + 1e-6).all()
    c.copy_slot(2, 1, 5)
    assert torch.equal(c.k_scale[0][1], ks[2]) and torch.equal(c.k[0][1].float(), c.k[0][2].float())
    kt = torch.randn(3, 2, 16)
    c.write_token(0, 3, torch.tensor([5, 5, 5]), kt, kt)
    deq = dequantize(c.k[0][:, :, 5], c.k_scale[0], torch.float32)
    assert ((deq - kt).abs() <= kt.abs() * 2**-4 + 1e-6).all()
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCache(_View(torch.device("cpu")), 1, 8, kv_dtype="int4")


def hf_rope(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


@pytest.mark.skipif(not CUDA, reason="the fused kernel runs on CUDA (its reference runs everywhere)")
@pytest.mark.parametrize("fp8", [False, True])
def test_rope_kv_kernel_matches_reference(fp8):
    torch.manual_seed(2)
    dev, dt = torch.device("cuda"), torch.bfloat16
    s, h, n_kv, d, cap = 5, 8, 2, 128, 64
    qkv = torch.randn(s, (h + 2 * n_kv) * d, device=dev, dtype=dt)
    q, k, v = qkv.split([h * d, n_kv * d, n_kv * d], -1)  # strided views, as the fused group returns
    ang = torch.rand(cap, d // 2, device=dev) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(dt), torch.cat([ang.sin()] * 2, -1).to(dt)
    pos = torch.tensor([0, 3, 63, 10, 10], device=dev)
    kd = torch.float8_e4m3fn if fp8 else dt
    caches = [torch.zeros(s + 1, n_kv, cap, d, device=dev, dtype=kd) for _ in range(4)]
    scales = [torch.rand(s + 1, n_kv, device=dev) + 0.01 for _ in range(2)] if fp8 else [None, None]
    got_q = rope_kv.rope_kv_write(q, k, v, cos, sin, pos, caches[0], caches[1], *scales)
    want_q = rope_kv.reference(q, k, v, cos, sin, pos, caches[2], caches[3], *scales)
    # the reference matches HF's rotate-half arithmetic
    hf_q = hf_rope(q.reshape(s, h, d).float(), cos[pos][:, None].float(), sin[pos][:, None].float())
    assert (want_q.float() - hf_q).abs().max() < 0.05
    assert (got_q.float() - want_q.float()).abs().max() <= 2 ** -7 * want_q.float().abs().max()
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        diff = (a.float() - b.float()).abs()
        assert diff.max() <= 2 ** -3 * b.float().abs().max()  # at most one rounding step apart
        assert (a.float() != 0).sum() == (b.float() != 0).sum()  # the same positions written


@pytest.mark.skipif(not CUDA, reason="FP8 conversion in the kernel runs on CUDA")
def test_fp8_attention_kernel_matches_dequantized_reference():
    torch.manual_seed(3)
    dev = torch.device("cuda")
    s, h, n_kv, d, cap = 4, 28, 4, 128, 1024
    q = torch.randn(s, h, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(s, n_kv, cap, d, device=dev)
    v = torch.randn(s, n_kv, cap, d, device=dev)
    ks, vs = k.abs().amax((2, 3)) / FP8_MAX, v.abs().amax((2, 3)) / FP8_MAX
    kq, vq = _quantize(k, ks), _quantize(v, vs)
    lens = torch.tensor([1, 200, 777, 1024], device=dev)
    got = attention.decode_attention(q, kq, vq, lens, cap, d ** -0.5, ks, vs)
    want = naive_attention(q.cpu(), dequantize(kq, ks, torch.float32).cpu(), dequantize(vq, vs, torch.float32).cpu(),
                           lens.cpu(), d ** -0.5)
    assert (got.cpu().double() - want).abs().max() < 2e-2
