"""The wgmma kernel (kernels/w4_wgmma.cu) on an H200, against a float64 dequantize-then-matmul.

Run on the device (`STEP=tests bash scripts/device.sh`): every M from 1 to 300 on the 7B groups, the 14B/32B/72B
group shapes and N that leave a CTA's rows partly empty, outputs poisoned with NaN before each run; two runs give
identical bits; LoRA with 1 and 3 segments (xa given, or shrunk by the launcher) equals base + the unfused expand;
a CUDA graph replays it; routed through mma_backend it matches the mma.sync path within bf16 noise; every tile
TUNING uses compiles, on this card's NVRTC, to no local memory and at least the CTAs per SM its plan assumes.
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")]

from qerl.formats.nvfp4_mma import NVFP4Mma  # noqa: E402
from qerl.kernels import dispatch, mma_backend, settings, w4_mma, w4_wgmma  # noqa: E402

MMA = NVFP4Mma()
SHAPES_7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]
SHAPES_BIG = [(7168, 5120), (27648, 5120), (5120, 27648), (55296, 5120), (10240, 8192), (59136, 8192), (8192, 29568)]
ODD = [(16, 64), (48, 192), (400, 576), (1040, 1536)]


@pytest.fixture(autouse=True)
def enabled():
    with settings.use(wgmma=True):
        yield


def _quant(n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * torch.rand(n, 1, device="cuda", generator=g) * 0.05
    return MMA.quantize(w.to(torch.bfloat16))


def _ref(t, shape, x, bias=None):
    y = x.double() @ MMA.dequantize(t, shape, torch.float64).T
    return y if bias is None else y + bias.double()


def _rel(a, b):
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), "NaN (an unwritten or poisoned element)"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _run(t, shape, x, bias=None, lora=None, config=None):
    n, _ = shape
    y = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
    factor, _ = mma_backend._prepare(t)
    return w4_wgmma.matmul(x, t["weight_packed"], t["weight_scale"], factor, n, bias=bias, lora=lora, config=config,
                           out=y)


def test_available():
    assert w4_wgmma.available(torch.device("cuda"))


@pytest.mark.parametrize("n,k", SHAPES_7B)
def test_every_m_1_to_300_on_7b_groups(n, k):
    t = _quant(n, k, n + k)
    for m in range(1, 301):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if m % 3 == 0 else None
        assert _rel(_run(t, (n, k), x, bias), _ref(t, (n, k), x, bias)) < 1e-2, f"M={m}"


@pytest.mark.parametrize("n,k", SHAPES_BIG + ODD)
@pytest.mark.parametrize("m", [9, 16, 33, 64, 128, 256])
def test_large_group_shapes_and_partial_ctas(n, k, m):
    t = _quant(n, k, n * 3 + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert _rel(_run(t, (n, k), x), _ref(t, (n, k), x)) < 1e-2


@pytest.mark.parametrize("m", [16, 64, 256])
def test_runs_are_bitwise_deterministic_with_split_k(m):
    n, k = 3584, 18944
    t = _quant(n, k, 11)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cfg = w4_wgmma.plan(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    assert cfg.splits > 1
    assert torch.equal(_run(t, (n, k), x), _run(t, (n, k), x))


@pytest.mark.parametrize("n,k,m", [(37888, 3584, 64), (3584, 18944, 64), (4608, 3584, 256), (3584, 18944, 256)])
def test_the_wave_plans_split_computes_the_product_and_repeats(n, k, m):
    # w4_wgmma.plan(waves=True): more K splits than the fill rule (bench kernels mode wgmma_waves)
    t = _quant(n, k, 13)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cfg = w4_wgmma.plan(m, n, k, sms, waves=True)
    y = _run(t, (n, k), x, config=cfg)
    assert _rel(y, _ref(t, (n, k), x)) < 1e-2
    assert all(torch.equal(_run(t, (n, k), x, config=cfg), y) for _ in range(5))


@pytest.mark.parametrize("xa_given", [True, False])
@pytest.mark.parametrize("segs", [1, 3])
@pytest.mark.parametrize("m", [9, 64, 200])
def test_lora_expand_in_the_epilogue(segs, m, xa_given):
    n, k, r = 4608, 3584, 32
    t = _quant(n, k, 5)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a = torch.randn(segs * r, k, device="cuda", dtype=torch.bfloat16) * 0.02
    b = torch.randn(n, r, device="cuda", dtype=torch.bfloat16) * 0.02
    starts = (3584, 4096)[: segs - 1]
    lora = dispatch.LoraTerm(None, b, 2.0, starts, a=a)  # without xa: matmul shrinks first (lora.shrunk)
    y = _run(t, (n, k), x, lora=lora.shrunk(x) if xa_given else lora)
    ref_lora = dispatch.LoraTerm(x.double() @ a.double().T, b.double(), 2.0, starts)
    ref = _ref(t, (n, k), x) + dispatch.lora_expand(ref_lora, torch.float64)
    assert _rel(y, ref) < 1e-2


def test_cuda_graph_replay_matches_eager():
    n, k, m = 4608, 3584, 64
    t = _quant(n, k, 3)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    eager = _run(t, (n, k), x)
    factor, _ = mma_backend._prepare(t)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    w4_wgmma.matmul(x, t["weight_packed"], t["weight_scale"], factor, n, out=out)  # compile outside the graph
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w4_wgmma.matmul(x, t["weight_packed"], t["weight_scale"], factor, n, out=out)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("m", [16, 48, 64])
def test_routed_through_the_backend_it_agrees_with_mma_sync(m):
    n, k = 3584, 3584
    t = _quant(n, k, 21)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    routed = mma_backend.matmul(x, MMA, t, (n, k))  # wgmma (settings.wgmma on here)
    factor, _ = mma_backend._prepare(t)
    small = w4_mma.matmul(x, t["weight_packed"], t["weight_scale"], factor, n)
    assert _rel(routed, small.double()) < 1e-2 and _rel(routed, _ref(t, (n, k), x)) < 1e-2


def test_every_tile_compiles_without_local_memory_at_the_planned_occupancy():
    """NVRTC's ptxas on the device may allocate otherwise than the nvcc wheel CI checks with (BN 256 sits at 254 of
    255 registers there): the driver's own numbers decide. Local bytes (spills or an indexed register array) must be
    0 and the occupancy API must allow the `ctas_per_sm` the plan assumes at the tile's shared memory."""
    import ctypes

    lib = torch.cuda._utils._get_gpu_runtime_library()
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bad = []
    for bn, tune in sorted(w4_wgmma.TUNING.items()):
        for lora in (False, True):
            cfg = w4_wgmma.plan(bn, 4608, 3584, sms, bn=bn)
            fn = w4_wgmma._kernel(cfg, False, lora, dev)
            regs, local, per_sm = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
            assert lib.cuFuncGetAttribute(ctypes.byref(regs), 4, fn.func) == 0  # CU_FUNC_ATTRIBUTE_NUM_REGS
            assert lib.cuFuncGetAttribute(ctypes.byref(local), 3, fn.func) == 0  # CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES
            assert lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(per_sm), fn.func, cfg.threads,
                                                                   cfg.smem_bytes()) == 0
            line = (f"BN {bn} wg {cfg.wg} pw {cfg.pw} stages {cfg.stages} lora {lora}: {regs.value} regs, "
                    f"{local.value} B local, {per_sm.value} CTAs/SM (plan {tune.get('ctas_per_sm', 1)})")
            print(line)
            if local.value or per_sm.value < tune.get("ctas_per_sm", 1):
                bad.append(line)
    assert not bad, "\n".join(bad)
