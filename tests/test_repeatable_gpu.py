"""What "repeatable" means for RL, for every kernel a repeatable routes list may name (kernels/routes.py BACKENDS
less NOT_REPEATABLE): the same call 20 times gives the same bits, at every M bucket, eager and replayed from a CUDA
graph, and with two streams busy at once. Each kernel is forced through mma_backend.matmul by a one-bucket table, so
what runs is what a layer runs (LoRA r32 on a fused q|k|v included); a kernel that cannot take an M is served by
the one mma_backend.runnable names, which is then the one checked."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

from qerl.formats import get_format  # noqa: E402
from qerl.formats.nvfp4_mma import NVFP4Mma  # noqa: E402
from qerl.kernels import dispatch, mma_backend, routes  # noqa: E402

REPEATABLE = [k for k in routes.BACKENDS if k not in routes.NOT_REPEATABLE]
N, K = 4608, 3584  # q|k|v of a 7B
MS = [1, 16, 33, 64, 100, 256, 2048]


@pytest.fixture(scope="module")
def weight():
    g = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    return NVFP4Mma().from_checkpoint(get_format("nvfp4").quantize(w), (N, K))


@pytest.fixture
def only(monkeypatch):
    def force(kernel):
        obj = {"any": {"nvfp4": [[None, kernel]]}}
        monkeypatch.setattr(routes, "_tables", lambda: routes.parse(obj))
        monkeypatch.setattr(routes.torch.cuda, "get_device_name", lambda device=None: "any")
        routes.table_for.cache_clear()
    yield force
    routes.table_for.cache_clear()


def _lora():
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(96, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    b = torch.randn(N, 32, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    return lambda: dispatch.LoraTerm(None, b, 2.0, (3584, 4096), a=a)


@pytest.mark.parametrize("kernel", REPEATABLE)
@pytest.mark.parametrize("lora", [False, True])
def test_twenty_calls_a_graph_and_two_streams_give_the_same_bits(kernel, lora, weight, only):
    if kernel in routes.KSPLIT or kernel.startswith("humming"):
        pytest.importorskip("humming")
    only(kernel)
    term = _lora() if lora else (lambda: None)
    call = lambda x: mma_backend.matmul(x, NVFP4Mma(), weight, (N, K), lora=term())  # noqa: E731
    for m in MS:
        x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
        first = call(x)
        for _ in range(19):
            assert torch.equal(call(x), first), (kernel, m)
        ref = x.double() @ NVFP4Mma().dequantize(weight, (N, K), torch.float64).T
        if not lora:
            assert float((first.double() - ref).norm() / ref.norm()) < 8e-3
        static = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as capture needs
            call(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(static)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first), (kernel, m, "graph")
        streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        outs = []
        for s in streams:
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                outs += [call(x) for _ in range(5)]
        torch.cuda.synchronize()
        assert all(torch.equal(o, first) for o in outs), (kernel, m, "two streams")
