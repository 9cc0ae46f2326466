"""humming-kernels as a qerl backend (kernels/humming_backend.py) on the GPU, against a float64
dequantize-then-matmul of the same compressed-tensors bytes (qerl's own formats, independent of humming).

Fresh random inputs per case; 7B fused shapes and odd ones; NVFP4 and MXFP4; with LoRA on a fused
group's segments it equals base + the unfused expand."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
humming = pytest.importorskip("humming")

from qerl.formats import get_format  # noqa: E402
from qerl.kernels import dispatch  # noqa: E402
from qerl.kernels import mma_backend, routes, settings, w4_mma, w4_wgmma  # noqa: E402
from qerl.formats.nvfp4_mma import NVFP4Mma  # noqa: E402
from qerl.kernels.humming_backend import HummingWeight, available, supports_shape  # noqa: E402
from qerl.kernels.humming_ksplit import KSplitWeight  # noqa: E402

SHAPES = [(4608, 3584), (3584, 18944), (512, 256), (1152, 1536)]


def _weights(fmt, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * torch.rand(n, 1, device="cuda", generator=g) * 0.05
    return get_format(fmt).quantize(w.to(torch.bfloat16))


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_available_on_this_gpu():
    assert available()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_matmul_matches_the_dequantized_reference(fmt, n, k, m):
    t = _weights(fmt, n, k, seed=n + k + m)
    ref_w = get_format(fmt).dequantize(t, (n, k), torch.float64)
    hw = HummingWeight.build(fmt, t, (n, k))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = hw.matmul(x)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, x.double() @ ref_w.T) < 8e-3  # bf16 output rounding (2^-9) plus fp32 accumulation


def test_lora_on_a_fused_group_equals_base_plus_the_unfused_expand():
    n, k, r = 4608, 3584, 32
    starts = (3584, 4096)  # q | k | v
    t = _weights("nvfp4", n, k, seed=1)
    hw = HummingWeight.build("nvfp4", t, (n, k))
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(3 * r, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, r, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = hw.matmul(x, bias=bias, lora=dispatch.LoraTerm(None, b, 2.0, starts, a=a))
    ref_w = get_format("nvfp4").dequantize(t, (n, k), torch.float64)
    xa = x.double() @ a.double().T
    lo = torch.cat([xa[:, 0:32] @ b[:3584].double().T, xa[:, 32:64] @ b[3584:4096].double().T,
                    xa[:, 64:96] @ b[4096:].double().T], 1)
    assert _rel(y, x.double() @ ref_w.T + bias.double() + 2.0 * lo) < 8e-3


@pytest.mark.parametrize("backend", ["mma", "wgmma", "dequant_cublas", "humming_bi", "humming_ns", "humming_sk",
                                     "humming_ksplit4"])
def test_the_routed_mma_backend_runs_the_kernel_its_table_names(backend, monkeypatch):
    """mma_backend.matmul on MMA-layout bytes, with a table that sends this shape to `backend` at every M: the kernel
    that runs is the one named (or, where it cannot take this M, the one mma_backend.runnable says serves it),
    counted by spies on each kernel's entry point, not inferred from outputs; humming's names give HummingWeight's
    result in that mode on the same weight, bit for bit where the mode repeats."""
    n, k = 4608, 3584
    ran = {"humming": 0, "mma": 0, "wgmma": 0, "dequant_cublas": 0}

    def spy(kind, fn):
        def counted(*a, **kw):
            ran[kind] += 1
            return fn(*a, **kw)
        return counted
    monkeypatch.setattr(HummingWeight, "matmul", spy("humming", HummingWeight.matmul))
    monkeypatch.setattr(KSplitWeight, "matmul", spy("humming", KSplitWeight.matmul))
    for kind, mod, name in (("wgmma", w4_wgmma, "matmul"), ("mma", w4_mma, "matmul"),
                            ("dequant_cublas", w4_mma, "dequant_matmul")):
        monkeypatch.setattr(mod, name, spy(kind, getattr(mod, name)))
    streamk = backend == "humming_sk"  # only the stream-K list may name it
    lists = {"nvfp4_streamk": [[None, backend]]} if streamk else {"nvfp4": [[None, backend]]}
    obj = {"any": {"nvfp4": [[None, "mma"]], "shapes": {routes.shape_key((n, k)): {"nvfp4": [[None, "mma"]], **lists}}}}
    monkeypatch.setattr(routes, "_tables", lambda: routes.parse(obj))
    monkeypatch.setattr(routes.torch.cuda, "get_device_name", lambda device=None: "any")
    routes.table_for.cache_clear()
    try:
        with settings.use(humming_deterministic=not streamk):
            std = _weights("nvfp4", n, k, seed=3)
            mma = NVFP4Mma().from_checkpoint(std, (n, k))
            hw = HummingWeight.build("nvfp4", std, (n, k))
            ks = KSplitWeight.build(std, (n, k), routes.KSPLIT[backend]) if backend in routes.KSPLIT else None
            for m in (1, 16, 64, 256, 300):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                assert routes.pick(m, x.device, (n, k)) == backend
                served = mma_backend.runnable(backend, m, x.device)
                before = dict(ran)
                y = mma_backend.matmul(x, NVFP4Mma(), mma, (n, k))
                counted = {kind: ran[kind] - before[kind] for kind in ran}
                kind = "humming" if served in routes.STORED else served
                assert counted[kind] >= 1 and sum(counted.values()) == counted[kind], (m, served, counted)
                ref = x.double() @ NVFP4Mma().dequantize(mma, (n, k), torch.float64).T
                assert _rel(y, ref) < 8e-3
                if kind != "humming":
                    continue
                theirs = ks.matmul(x) if backend in routes.KSPLIT else hw.matmul(x, backend=backend)
                if not streamk:
                    assert torch.equal(y, theirs), m  # the same kernel on the same bytes
                else:  # stream-K: two runs differ by bf16 output roundings (H100: 0.0044 relative at M = 64)
                    assert _rel(y, theirs) < 1e-2, m
            assert not supports_shape((1088, 1536)) and supports_shape((1152, 1536))
    finally:
        routes.table_for.cache_clear()


@pytest.mark.parametrize("backend", ["humming_bi", "humming_ns"])
@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_the_same_input_gives_the_same_bits(m, backend):
    """Seeded rollouts repeat and graphs equal eager steps only if each GEMM does (humming's stream-K did not):
    each of its modes a repeatable list may name."""
    n, k = 4608, 3584
    hw = HummingWeight.build("nvfp4", _weights("nvfp4", n, k, seed=3), (n, k))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    first = hw.matmul(x, backend=backend)
    assert all(torch.equal(first, hw.matmul(x, backend=backend)) for _ in range(8))
    ref = x.double() @ NVFP4Mma().dequantize(NVFP4Mma().from_checkpoint(_weights("nvfp4", n, k, seed=3), (n, k)),
                                              (n, k), torch.float64).T
    assert _rel(first, ref) < 8e-3


@pytest.mark.parametrize("m", [1, 64])
def test_the_shrink_beside_the_gemm_gives_the_same_bits_eager_and_from_a_graph(m):
    """KernelSettings.lora_overlap runs the same kernels, only the shrink on a side stream: the same bits, also when
    the fork and join are captured in a CUDA graph and replayed with new inputs."""
    n, k = 4608, 3584
    hw = HummingWeight.build("nvfp4", _weights("nvfp4", n, k, seed=5), (n, k))
    a = torch.randn(96, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, 32, device="cuda", dtype=torch.bfloat16) * 0.02
    term = lambda: dispatch.LoraTerm(None, b, 2.0, (3584, 4096), a=a)  # noqa: E731
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = hw.matmul(x, lora=term())
    with settings.use(lora_overlap=True):
        assert torch.equal(hw.matmul(x, lora=term()), ref)
        static = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on the capture's kind of stream (configs, workspaces)
            hw.matmul(static, lora=term())
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = hw.matmul(static, lora=term())
        x2 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        static.copy_(x2)
        g.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, hw.matmul(x2, lora=term()))
