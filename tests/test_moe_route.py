"""moe_gemv's counting sort of a step's token-expert pairs (KernelSettings.moe_route_counting: the fallback of the
one-launch kernel, kernels/moe_route.py, tested in test_moe_route_kernel.py) against the argsort route: every Routing field bit-equal, dtypes included, over random
decode shapes with "no expert" indices; and fewer kernel-launching aten ops, no sort, nothing that
reads the device back on the host."""

import dataclasses
import importlib.util
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qerl.kernels import moe_gemv
from qerl.kernels.moe_gemv import Routing

TRITON = importlib.util.find_spec("triton") is not None


# The reference: the argsort route, the first one (the GEMV's tests checked it against a float64 product).
_route_reference = moe_gemv._route_sorted


def _assert_same(top_k_index, num_experts):
    want, got = _route_reference(top_k_index, num_experts), moe_gemv._route_counting(top_k_index, num_experts)
    for f in dataclasses.fields(Routing):
        a, b = getattr(want, f.name), getattr(got, f.name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), (f.name, tuple(top_k_index.shape), num_experts, a, b)
        else:
            assert a == b, f.name


def _indices(gen, t, k, e, dtype, none_rate):
    """[t, k] top-k choices (distinct in a token where k <= E), a share of them E ("no expert")."""
    if k <= e:
        idx = torch.rand(t, e, generator=gen).argsort(1)[:, :k]
    else:
        idx = torch.randint(0, e, (t, k), generator=gen)
    idx[torch.rand(t, k, generator=gen) < none_rate] = e
    return idx.to(dtype).contiguous()  # as topk's output


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("e", [4, 32, 128])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_route_equals_the_argsort_version(k, e, dtype):
    gen = torch.Generator().manual_seed(59 * 1000 + k * 10 + e)
    for t in range(1, 65):
        _assert_same(_indices(gen, t, k, e, dtype, none_rate=(0.0, 0.1, 0.5)[t % 3]), e)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_route_edge_cases_equal_the_argsort_version(dtype):
    gen = torch.Generator().manual_seed(5)
    for t, k, e in [(1, 1, 4), (1, 8, 128), (64, 8, 128), (3, 4, 4), (16, 8, 128), (64, 1, 128)]:
        _assert_same(torch.full((t, k), e, dtype=dtype), e)  # every pair "no expert"
        _assert_same(torch.zeros(t, k, dtype=dtype), e)  # one expert takes all
        _assert_same(_indices(gen, t, k, e, dtype, 0.0).flip(0), e)
        odd = _indices(gen, t, k, e, dtype, 0.2)  # out of range: both clamp to [0, E]
        odd[torch.rand(t, k, generator=gen) < 0.2] = -1
        odd[torch.rand(t, k, generator=gen) < 0.2] = e + 3
        _assert_same(odd, e)


class _OpLog(TorchDispatchMode):
    """The aten ops a call dispatches (CPU tensors: counted here, launched on CUDA)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


_ALLOC_ONLY = {"empty", "empty_like", "empty_strided", "new_empty"}  # no kernel: the allocator only


def launching_ops(fn, top_k_index, num_experts) -> list[str]:
    """The aten ops of fn that launch a kernel on CUDA: views and bare allocations left out. A proxy for
    launches that undercounts a sort (one op, several launches on CUDA)."""
    with _OpLog() as log:
        fn(top_k_index, num_experts)
    names = [(f.overloadpacket.__name__, f.is_view) for f in log.ops]
    return [name for name, view in names if not view and name not in _ALLOC_ONLY]


def test_route_launches_fewer_ops_no_sort_no_host_read():
    idx = _indices(torch.Generator().manual_seed(0), 64, 8, 128, torch.int64, 0.0)  # the profiled decode step
    old, new = launching_ops(_route_reference, idx, 128), launching_ops(moe_gemv._route_counting, idx, 128)
    assert len(new) < len(old), (old, new)
    # no general sort; nothing that syncs (a scalar read, nonzero, bincount's size read)
    assert not {"sort", "argsort", "_local_scalar_dense", "nonzero", "bincount", "unique"} & set(new), new


def test_route_takes_the_counting_sort_where_the_kernel_is_off_and_the_argsorts_when_switched_off(monkeypatch):
    """On CPU tensors (outside the interpreter) the one-launch kernel does not apply: the counting sort runs."""
    from qerl.kernels import settings

    idx = torch.randint(0, 33, (16, 4), generator=torch.Generator().manual_seed(1))
    calls = []
    real = moe_gemv._route_counting
    monkeypatch.setattr(moe_gemv, "_route_counting", lambda *a: calls.append(a) or real(*a))
    with settings.use(moe_route_counting=False):
        want = moe_gemv.route(idx, 32)
    assert not calls
    got = moe_gemv.route(idx, 32)
    assert len(calls) == 1
    for f in dataclasses.fields(want):
        a, b = getattr(want, f.name), getattr(got, f.name)
        assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b, f.name


@pytest.mark.skipif(not TRITON, reason="the one-launch route needs Triton (its interpreter on the CPU)")
def test_route_takes_the_one_launch_kernel_by_default_and_falls_back_outside_its_bounds(monkeypatch):
    from qerl.kernels import moe_route, settings

    monkeypatch.setattr(moe_route, "RUN_ON_CPU_INTERPRETER", True)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and not in the Triton interpreter")
    fused, counting = [], []
    real_f, real_c = moe_route.route_fused, moe_gemv._route_counting
    monkeypatch.setattr(moe_route, "route_fused", lambda *a: fused.append(a) or real_f(*a))
    monkeypatch.setattr(moe_gemv, "_route_counting", lambda *a: counting.append(a) or real_c(*a))
    idx = torch.randint(0, 33, (16, 4), generator=torch.Generator().manual_seed(1))
    got = moe_gemv.route(idx, 32)
    assert (len(fused), len(counting)) == (1, 0)
    want = real_c(idx, 32)
    for f in dataclasses.fields(want):
        a, b = getattr(want, f.name), getattr(got, f.name)
        assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b, f.name
    moe_gemv.route(idx, 300)  # more experts than the kernel holds (256): the counting sort
    moe_gemv.route(idx.to(torch.int16), 32)  # a dtype it does not read
    assert (len(fused), len(counting)) == (1, 2)
    with settings.use(moe_route_fused=False):
        moe_gemv.route(idx, 32)
    assert (len(fused), len(counting)) == (1, 3)
