"""KernelSettings.moe_expert_chunk_mib: the grouped MoE path dequantizes as many hit experts at once as a byte
budget holds, so a training micro-batch (every expert hit) runs fewer chunks, each with its own launches and
host syncs; the outputs and gradients are those of the 16-a-chunk default, and the memory model reads the case."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from qerl.bench.memory_fit import settings_of_case
from qerl.bench.step_plan import BF16, MOE_SHAPES, expert_shapes
from qerl.kernels import settings
from qerl.layers.quant_experts import QuantExperts

E, H, I, T, K = 40, 32, 16, 64, 4  # every expert hit: 256 pairs over 40 experts


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _experts():
    g = torch.Generator().manual_seed(0)
    gu, dn = torch.randn(E, 2 * I, H, generator=g) * 0.05, torch.randn(E, H, I, generator=g) * 0.05

    def glu(y):
        a, b = y.chunk(2, -1)
        return torch.nn.functional.silu(a) * b

    qe = QuantExperts.quantize(gu, dn, "nvfp4", glu, torch.float32)
    qe.add_lora(4, 8.0)
    with torch.no_grad():
        for b in qe.lora_B.values():
            b.normal_(0, 0.05, generator=g)
    qe.grouped = True
    h = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return qe, h, idx, torch.rand(T, K, generator=g)


def _run(qe, h, idx, w, **kw):
    qe.zero_grad()
    x = h.clone().requires_grad_(True)
    with settings.use(**kw), OpCount() as c:
        y = qe(x, idx, w)
        y.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in qe.named_parameters()}
    return y.detach(), x.grad, grads, c.ops["aten._grouped_mm"]


def test_chunk_size_is_the_budget_over_the_larger_projection():
    qe, *_ = _experts()
    assert qe.chunk_experts(torch.float32) == qe.expert_chunk == 16  # no budget: the GPU-tested default
    per = 2 * I * H * 4  # gate|up [2I, H] is the larger projection, fp32
    with settings.use(moe_expert_chunk_mib=1):
        assert qe.chunk_experts(torch.float32) == (1 << 20) // per
        assert qe.chunk_experts(torch.bfloat16) == (1 << 20) // (per // 2)
    qe.shapes = {"gate_up_proj": (4096, 4096), "down_proj": (4096, 2048)}  # 32 MiB an expert in bf16
    with settings.use(moe_expert_chunk_mib=1):
        assert qe.chunk_experts(torch.bfloat16) == 1  # never below one expert


def test_a_budget_that_holds_every_expert_gives_the_same_outputs_and_gradients_in_fewer_launches():
    qe, h, idx, w = _experts()
    y0, gx0, g0, mm0 = _run(qe, h, idx, w)  # 16 a chunk: 3 chunks of the 40 hit experts
    y1, gx1, g1, mm1 = _run(qe, h, idx, w, moe_expert_chunk_mib=64)  # one chunk
    assert torch.allclose(y1, y0, rtol=1e-5, atol=1e-6) and torch.allclose(gx1, gx0, rtol=1e-5, atol=1e-6)
    assert g0 and all(torch.allclose(g1[n], g, rtol=1e-5, atol=1e-6) for n, g in g0.items())
    assert mm1 * 3 == mm0  # every grouped matmul, forward and backward, once a chunk


def test_the_memory_model_reads_the_budget_from_a_case():
    case = "qwen3-30b-a3b nvfp4 8x8 prompt256 new256 mu1 mb8 ckpt kv3.4 adamw_torch echunk1024mib"
    shape, st = settings_of_case(case)
    per = max(o * i for o, i in expert_shapes(MOE_SHAPES["qwen3-30b-a3b"])) * BF16
    assert st.expert_chunk == (1024 << 20) // per and st.expert_chunk >= shape.experts  # all 128 in one chunk
    _, default = settings_of_case(case.replace(" echunk1024mib", ""))
    assert default.expert_chunk == 16


@pytest.mark.parametrize("mib", [None, 512])
def test_bench_step_names_the_budget_in_its_case_and_the_model_reads_it_back(mib):
    import argparse

    from qerl.bench import step

    a = argparse.Namespace(shape="qwen3-30b-a3b", layers=None, prompts=8, num_generations=8, prompt_len=256,
                           max_new_tokens=256, num_iterations=1, micro_batch=8, gradient_checkpointing=True,
                           kv_cache_gb=3.4, optim="adamw_torch", memory_cap_gb=None, expert_chunk_mib=mib)
    label = step.case_name(a, "nvfp4")
    assert ("echunk512mib" in label) == (mib == 512)
    _, st = settings_of_case(label)
    assert st.expert_chunk == (16 if mib is None else (512 << 20) // (1536 * 2048 * BF16))


def test_host_chunks_bound_each_chunk_as_the_device_counts_do():
    """_host_chunks against the default path's arithmetic on the device tensors, "no expert" pairs included."""
    from qerl.layers.quant_experts import _host_chunks

    g = torch.Generator().manual_seed(1)
    flat = torch.randint(0, 13, (90,), generator=g)  # 12 experts and the "no expert" index 12
    flat[flat == 5] = 4  # an expert with no pairs between hit ones
    counts = torch.bincount(flat.sort().values, minlength=12)
    ends = torch.cumsum(counts, 0)
    hit = [e for e in counts.nonzero()[:, 0].tolist() if e < 12]
    got = list(_host_chunks(counts, 12, 4, torch.device("cpu")))
    assert [c[0] for c in got] == [hit[i:i + 4] for i in range(0, len(hit), 4)]
    for experts, lo, hi, group_ends, ids in got:
        assert (lo, hi) == (int(ends[experts[0]] - counts[experts[0]]), int(ends[experts[-1]]))
        assert torch.equal(group_ends, torch.cumsum(counts[experts], 0).to(torch.int32))
        assert ids.tolist() == experts
