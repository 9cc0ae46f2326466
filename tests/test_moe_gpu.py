"""The MoE families on a GPU (skipped without one): the engine's greedy tokens equal HF generate on the
same modules (experts through the grouped GEMV in decode, attention through the W4 kernels), eager and
replayed from CUDA graphs (Engine(cuda_graphs=True): capturable where the GEMV runs decode), and the
grouped path (torch._grouped_mm) equals the loop."""

import pytest
import torch

from qerl.layers.quant_experts import QuantExperts
from qerl.model import load_policy
from test_families import NEW, PROMPTS, engine_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def hf_greedy(m, prompt):
    gc = m.generation_config
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = [], 0, False
    out = m.generate(torch.tensor([prompt], device="cuda"), generation_config=gc, max_new_tokens=NEW)
    return out[0, len(prompt):].tolist()


def _policy(family, root):
    if family == "gpt_oss":
        from test_gpt_oss import write_stock_mxfp4

        write_stock_mxfp4(root)
    else:
        from test_moe_experts import tiny_moe

        tiny_moe(family).save_pretrained(root)
    return load_policy(str(root), "nvfp4", lora_rank=4, target_modules=["q", "k", "v", "o", "experts"],
                       device="cuda", dtype=torch.float32, progress=False)


def _randomize_lora_b(model, seed: int):
    """B away from zero, so the adapters change the outputs."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.2)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_engine_greedy_equals_hf_generate_on_the_gpu(family, tmp_path):
    pol = _policy(family, tmp_path)
    _randomize_lora_b(pol.model, seed=1)
    got = engine_greedy(pol.model)
    assert got == [hf_greedy(pol.model, p) for p in PROMPTS]


@pytest.mark.parametrize("route", ["argsort", "counting", "fused"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_engine_greedy_from_cuda_graphs_equals_hf_generate(family, route, tmp_path):
    """Each way the decode routes its pairs (two argsorts, the counting sort, the one-launch kernel: the default),
    captured in the graphs too."""
    from qerl.kernels.settings import KernelSettings
    from qerl.rollout import Engine, SamplingParams

    pol = _policy(family, tmp_path)
    ks = KernelSettings(moe_route_counting=route != "argsort", moe_route_fused=route == "fused")
    eng = Engine(pol.model, max_len=128, max_slots=3, sync_every=4, cuda_graphs=True, kernel_settings=ks)
    outs = eng.generate(PROMPTS, n=1, params=SamplingParams(max_new_tokens=NEW, greedy=True, ignore_eos=True))
    assert eng.runner.graphs_captured > 0
    assert [c.token_ids for c in outs] == [hf_greedy(pol.model, p) for p in PROMPTS]


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_grouped_path_equals_the_loop_on_the_gpu(family, tmp_path):
    pol = _policy(family, tmp_path)
    ids = torch.arange(3, 67, device="cuda").view(2, 32)
    out = []
    for grouped in (False, True):
        for m in pol.model.modules():
            if isinstance(m, QuantExperts):
                m.grouped = grouped
        with torch.no_grad():
            out.append(pol.model(ids).logits)
    assert torch.allclose(out[0], out[1], atol=1e-4, rtol=1e-4), (out[0] - out[1]).abs().max()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_budgeted_expert_chunks_equal_the_default_chunks_on_the_gpu(family, tmp_path, monkeypatch):
    """KernelSettings.moe_expert_chunk_mib (bounds from one read of the counts, index tensors copied without
    waiting): logits and expert-LoRA gradients of the grouped path as with 16 experts a chunk (here 2, so
    the default takes several chunks and the budget one)."""
    from qerl.kernels import settings

    pol = _policy(family, tmp_path)
    _randomize_lora_b(pol.model, seed=2)
    for m in pol.model.modules():
        if isinstance(m, QuantExperts):
            m.grouped, m.expert_chunk = True, 2
    ids = torch.arange(3, 67, device="cuda").view(2, 32)
    calls, project = [], QuantExperts._grouped_project

    def counted(self, *a, **k):
        calls[-1] += 1
        return project(self, *a, **k)

    monkeypatch.setattr(QuantExperts, "_grouped_project", counted)
    out = []
    for mib in (None, 256):
        calls.append(0)
        pol.model.zero_grad()
        with settings.use(moe_expert_chunk_mib=mib):
            logits = pol.model(ids).logits
            logits.float().logsumexp(-1).sum().backward()
        torch.cuda.synchronize()
        out.append((logits.detach(), {n: p.grad.clone() for n, p in pol.model.named_parameters()
                                      if "experts.lora" in n and p.grad is not None}))
    assert calls[1] < calls[0]  # the budget took fewer, larger chunks
    assert torch.allclose(out[0][0], out[1][0], atol=1e-4, rtol=1e-4), (out[0][0] - out[1][0]).abs().max()
    assert out[0][1] and out[0][1].keys() == out[1][1].keys()
    for n, gr in out[0][1].items():
        assert torch.allclose(out[1][1][n], gr, atol=1e-4, rtol=1e-3), n
