"""humming's stream-K on grids with at most two slices a tile (kernels/humming_sk2.py) on the GPU: what "repeatable"
means for RL. The same call 20 times gives the same bits at every M bucket, eager and from a CUDA graph, and with two
streams busy at once; it computes the product (against a float64 dequantize-then-matmul of the same bytes); and every
grid it names keeps each tile within two slices by the scheduler's port."""

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
humming = pytest.importorskip("humming")

from qerl.formats import get_format  # noqa: E402
from qerl.kernels.humming_backend import HummingWeight, sk2_tuning  # noqa: E402
from qerl.kernels.humming_sk2 import Tiling, schedule  # noqa: E402

SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]
MS = [1, 16, 33, 64, 100, 128, 256, 2048]
_W: dict = {}


def _weight(n, k):
    if (n, k) not in _W:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        t = get_format("nvfp4").quantize(w)
        _W[(n, k)] = (t, HummingWeight.build("nvfp4", t, (n, k)))
    return _W[(n, k)]


def _call(hw, x):
    return hw.matmul(x, backend="humming_sk2")


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_split_config_stays_within_the_slices_that_add_in_order(n, k):
    _, hw = _weight(n, k)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for lo, hi, cfg in json.loads(sk2_tuning(hw.layer.humming_config, torch.device("cuda"))):
        if cfg.get("use_stream_k", True):
            t = Tiling.of(cfg, n, k)
            assert schedule(t, hi, t.groups(cfg.get("num_sms") or sms)).max_slices <= t.max_ordered_slices, (lo, hi, cfg)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_twenty_calls_give_the_same_bits_and_the_product(n, k, m):
    t, hw = _weight(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    first = _call(hw, x)
    for _ in range(19):
        assert torch.equal(_call(hw, x), first)
    ref = x.double() @ get_format("nvfp4").dequantize(t, (n, k), torch.float64).T
    assert float((first.double() - ref).norm() / ref.norm()) < 8e-3


@pytest.mark.parametrize("n,k", SHAPES[:2] + SHAPES[3:])
@pytest.mark.parametrize("m", [16, 64, 256])
def test_a_graph_replay_and_two_busy_streams_give_the_eager_bits(n, k, m):
    _, hw = _weight(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    eager = _call(hw, x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            _call(hw, x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = _call(hw, x)
    for _ in range(5):
        g.replay()
        assert torch.equal(out, eager)
    outs = []  # two streams at once, each with its own lock buffer (HummingWeight.run)
    for s in (torch.cuda.Stream(), torch.cuda.Stream()):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append([_call(hw, x) for _ in range(10)])
    torch.cuda.synchronize()
    assert all(torch.equal(o, eager) for os_ in outs for o in os_)
