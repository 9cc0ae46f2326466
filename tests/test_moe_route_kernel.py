"""The one-launch Triton route (kernels/moe_route.py) against moe_gemv's counting sort: every Routing field
bit-equal, dtypes included, over random top-k routings at decode shapes, "no expert" and out-of-range
indices, one expert taking all pairs; a plain-Python reference for one small case; and supports()'s bounds.
On the CPU the kernel runs in Triton's interpreter."""

import dataclasses
import os

import pytest
import torch

triton = pytest.importorskip("triton")
from qerl.kernels import moe_gemv, moe_route  # noqa: E402
from qerl.kernels.moe_gemv import Routing  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and not in the Triton interpreter", allow_module_level=True)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    if not CUDA:
        monkeypatch.setattr(moe_route, "RUN_ON_CPU_INTERPRETER", True)


def _assert_same(top_k_index, num_experts):
    assert moe_route.supports(top_k_index, num_experts)
    _assert_equal(moe_gemv._route_counting(top_k_index, num_experts), moe_route.route_fused(top_k_index, num_experts),
                  top_k_index, num_experts)


def _assert_equal(want, got, top_k_index, num_experts):
    for f in dataclasses.fields(Routing):
        a, b = getattr(want, f.name), getattr(got, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), (f.name, tuple(top_k_index.shape), num_experts, a, b)
        else:
            assert a == b, f.name


def _indices(gen, t, k, e, dtype, none_rate):
    """[t, k] top-k choices (distinct in a token), a share of them E ("no expert")."""
    idx = torch.rand(t, e, generator=gen).argsort(1)[:, :k]
    idx[torch.rand(t, k, generator=gen) < none_rate] = e
    return idx.to(dtype).to(DEV).contiguous()


# (T, k, E): one token; Qwen3-30B-A3B and gpt-oss-20b decode at 64 sequences; P = 15, 21 (not powers of
# two); one expert; the bounds (P = 1024, E = 256).
SHAPES = [(1, 8, 128), (64, 8, 128), (64, 4, 32), (5, 3, 7), (7, 3, 4), (3, 1, 1), (128, 8, 256)]


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("t,k,e", SHAPES)
def test_random_routings_equal_the_counting_sort(t, k, e, dtype):
    gen = torch.Generator().manual_seed(t * 1000 + k * 10 + e)
    for none_rate in (0.0, 0.3):
        _assert_same(_indices(gen, t, k, e, dtype, none_rate), e)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_edge_cases_equal_the_counting_sort(dtype):
    gen = torch.Generator().manual_seed(5)
    for t, k, e in [(1, 1, 4), (6, 4, 32), (3, 4, 4)]:
        _assert_same(torch.zeros(t, k, dtype=dtype, device=DEV), e)  # one expert takes every pair
        _assert_same(torch.full((t, k), e - 1, dtype=dtype, device=DEV), e)  # the last one does
        _assert_same(torch.full((t, k), e, dtype=dtype, device=DEV), e)  # every pair "no expert"
        odd = _indices(gen, t, k, e, dtype, 0.2).cpu()  # out of range: both clamp to [0, E]
        odd[torch.rand(t, k, generator=gen) < 0.2] = -1
        odd[torch.rand(t, k, generator=gen) < 0.2] = e + 3
        _assert_same(odd.to(DEV), e)


def test_a_small_case_against_plain_python():
    """4 tokens, top-2 of 6 experts, one "no expert" pair: the sorted pairs by (class, index), the slots."""
    rows = [[3, 1], [3, 5], [6, 3], [5, 1]]
    e, k = 6, 2
    pairs = [x for row in rows for x in row]
    order = sorted(range(len(pairs)), key=lambda i: (pairs[i], i))
    counts = [pairs.count(x) for x in range(e)]
    starts = [sum(counts[:x]) for x in range(e)]
    slots = ([x for x in range(e) if counts[x]] + [x for x in range(e) if not counts[x]])[:min(e, len(pairs))]
    ends = [sum(counts[x] for x in slots[:j + 1]) for j in range(len(slots))] + [len(pairs)]
    r = moe_route.route_fused(torch.tensor(rows, device=DEV), e)
    assert r.order.tolist() == order == [1, 7, 0, 2, 5, 3, 6, 4]
    assert r.token.tolist() == [i // k for i in order]
    assert r.expert.tolist() == [min(pairs[i], e - 1) for i in order]
    assert r.valid.tolist() == [pairs[i] < e for i in order]
    assert slots == [1, 3, 5, 0, 2, 4]
    assert r.slot_expert.tolist() == slots
    assert r.slot_start.tolist() == [starts[x] for x in slots] == [0, 2, 5, 0, 2, 5]
    assert r.slot_count.tolist() == [counts[x] for x in slots] == [2, 3, 2, 0, 0, 0]
    assert r.ends.tolist() == ends == [2, 5, 7, 7, 7, 7, 8]
    assert r.tokens == 4


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_replays_in_a_cuda_graph():
    """Nothing read back to the host: captured once, replayed on new indices, still equal."""
    gen = torch.Generator().manual_seed(3)
    idx = _indices(gen, 64, 8, 128, torch.int64, 0.0)
    moe_route.route_fused(idx, 128)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = moe_route.route_fused(idx, 128)
    for none_rate in (0.0, 0.3):
        idx.copy_(_indices(gen, 64, 8, 128, torch.int64, none_rate))
        graph.replay()
        _assert_equal(moe_gemv._route_counting(idx, 128), got, idx, 128)


def test_supports_refuses_what_is_out_of_bounds(monkeypatch):
    idx = torch.zeros(128, 8, dtype=torch.int64, device=DEV)  # P = 1024, the most
    assert moe_route.supports(idx, 256)
    assert not moe_route.supports(idx, 257)  # too many experts
    assert not moe_route.supports(torch.zeros(129, 8, dtype=torch.int64, device=DEV), 128)  # too many pairs
    assert not moe_route.supports(torch.zeros(0, 8, dtype=torch.int64, device=DEV), 128)  # no pairs
    assert not moe_route.supports(idx, 0)
    assert not moe_route.supports(idx.float(), 128)
    assert not moe_route.supports(idx.to(torch.int16), 128)
    monkeypatch.setattr(moe_route, "RUN_ON_CPU_INTERPRETER", False)
    assert not moe_route.supports(idx.cpu(), 128)  # CPU tensors only in the interpreter tests


def test_import_needs_no_triton():
    import subprocess
    import sys

    code = "import sys, qerl.kernels.moe_route; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
