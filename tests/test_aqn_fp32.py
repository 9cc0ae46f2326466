"""AQN reaches the model at every sigma (issue 21.1): the noise is added in fp32 inside the norm, so
bf16 rounding of w + Z cannot erase it; the weights are never written; the engine's decode glue and
the norm modules apply the same Z; the effective sigma follows the schedule."""

import pytest
import torch

from qerl.model import random_policy
from qerl.rl.aqn import AQN, sigma_at
from qerl.rollout import Engine, SamplingParams
from qerl.rollout.forward import EAGER_GLUE, ModelView, _norm, rms_norm
from tiny_models import config

SIGMAS = (5e-4, 1e-3, 1e-2)


def _bf16_policy(hidden=512, layers=2):
    """A bf16 policy whose norm weights are ~1 (1 + 0.05 N(0, 1)), as in trained Llama/Qwen models."""
    cfg = config("llama", hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=8, num_key_value_heads=4)
    pol = random_policy(cfg, "bf16", lora_rank=4, device="cpu", dtype=torch.bfloat16, std=0.05, progress=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, m in pol.model.named_modules():
            if name.endswith("layernorm"):
                m.weight.copy_(1 + 0.05 * torch.randn(m.weight.shape, generator=g))
    return pol.model


def _norm_io(model, ids):
    """(input, output) of every noised norm module during one forward pass."""
    seen, hooks = {}, []
    for n, m in model.named_modules():
        if n.endswith(("input_layernorm", "post_attention_layernorm")):
            hooks.append(m.register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, (a[0], out))))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


def _fp64_norm(x, w, eps):
    x = x.double()
    return w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _reach(aqn, io, noisy_out):
    """(gain, requested relative size): the least-squares gain of the noise in the norms' outputs on
    the fp64 reference noise (the same norm, input and Z in fp64; 1 = all of it arrived), and the
    reference noise's size relative to the reference output. noisy_out(name, x) gives the
    implementation's noisy output for input x."""
    dot = ref_sq = clean_sq = 0.0
    for name, (x, _) in io.items():
        w, eps, z = aqn.weights[name], aqn.eps[name], aqn.noise[name]
        ref_clean = _fp64_norm(x, w, eps)
        d_ref = _fp64_norm(x, w.double() + z.double(), eps) - ref_clean
        norm = aqn.norms[name]
        d_impl = noisy_out(name, x).double() - type(norm).forward(norm, x).double()  # HF's own clean output
        dot += float((d_impl * d_ref).sum())
        ref_sq += float(d_ref.pow(2).sum())
        clean_sq += float(ref_clean.pow(2).sum())
    return dot / ref_sq, (ref_sq / clean_sq) ** 0.5


@pytest.mark.parametrize("sigma", SIGMAS)
def test_noise_reaches_the_norm_outputs_at_every_sigma(sigma):
    model = _bf16_policy()
    aqn = AQN(model)
    ids = torch.randint(0, 160, (2, 64), generator=torch.Generator().manual_seed(2))
    with aqn.applied(sigma, seed=5):
        io = _norm_io(model, ids)  # the modules' outputs: the path of prefill and the trainer
        gain, rel = _reach(aqn, io, lambda name, x: io[name][1])
        # the old way, for contrast: w + Z rounded to bf16, then HF's arithmetic
        old, _ = _reach(aqn, io, lambda name, x: rms_norm(x, (aqn.weights[name].float() + aqn.noise[name])
                                                            .to(torch.bfloat16), aqn.eps[name]))
    assert rel == pytest.approx(sigma, rel=0.1)  # weights ~1: Z of std sigma is a relative change sigma
    assert gain == pytest.approx(1.0, abs=0.1), (sigma, gain)
    if sigma < 1e-3:
        assert abs(old) < 0.5, old  # bf16 rounding of w + Z erased most of it: what this fixes


def test_weights_are_never_written_and_the_model_is_bit_identical_after():
    model = _bf16_policy(hidden=128)
    aqn = AQN(model)
    before = {n: w.detach().clone() for n, w in aqn.weights.items()}
    ids = torch.randint(0, 160, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        clean = model(ids).logits
    with aqn.applied(1e-2, seed=1):
        assert all(torch.equal(w, before[n]) for n, w in aqn.weights.items())
        with torch.no_grad():
            assert not torch.equal(model(ids).logits, clean)
    with pytest.raises(RuntimeError):
        with aqn.applied(1e-2, seed=2):
            raise RuntimeError("boom")
    assert all(torch.equal(w, before[n]) for n, w in aqn.weights.items())
    assert all(not z.any() for z in aqn.noise.values())
    assert all("forward" not in m.__dict__ for m in aqn.norms.values())  # the class's own forward again
    with torch.no_grad():
        assert torch.equal(model(ids).logits, clean)


def test_fresh_noise_each_seed_and_the_same_noise_for_the_same_seed():
    aqn = AQN(_bf16_policy(hidden=128))
    z = next(iter(aqn.noise.values()))
    draws = []
    for seed in (1, 2, 1):
        with aqn.applied(0.01, seed):
            draws.append(z.clone())
    assert torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[1])


def test_effective_sigma_follows_the_schedule():
    aqn = AQN(_bf16_policy(hidden=512, layers=2))  # 4 norms x 512: the RMS of Z is within ~2 % of sigma
    T, K = 40, 8
    seen = []
    for step in range(T):
        sigma, stage = sigma_at(step, T, K, 1e-2, 5e-4)
        with aqn.applied(sigma, seed=step):
            pass
        seen.append(aqn.last_effective_sigma)  # read after the block, as the trainer does
        if stage == 0:
            assert seen[-1] == 0.0
        else:
            assert seen[-1] == pytest.approx(sigma, rel=0.06), (step, sigma, seen[-1])
    assert seen[-1] == pytest.approx(5e-4, rel=0.06)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_zero_noise_is_bit_identical_to_hf(dtype):
    """Outside a noisy block the engine reads a zero buffer: its norm must equal HF's exactly."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(256, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(256))
    x = (3 * torch.randn(64, 256)).to(dtype)
    want = norm(x)
    assert torch.equal(rms_norm(x, norm.weight, 1e-6), want)
    assert torch.equal(rms_norm(x, norm.weight, 1e-6, torch.zeros(256)), want)


def test_engine_glue_and_modules_apply_the_same_noise():
    model = _bf16_policy(hidden=128)
    aqn = AQN(model)
    view = ModelView(model)
    x = torch.randn(3, 5, 128).to(torch.bfloat16)
    for name, norm in aqn.norms.items():
        assert torch.equal(_norm(view, EAGER_GLUE, norm, x), norm(x))
    with aqn.applied(5e-4, seed=4):
        for name, norm in aqn.norms.items():
            glue = _norm(view, EAGER_GLUE, norm, x)
            assert torch.equal(glue, norm(x))
            assert not torch.equal(glue, type(norm).forward(norm, x))  # and it is not the clean output


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("device,compile", [("cpu", False), ("cpu", True), pytest.param("cuda", None, marks=CUDA)])
def test_engine_logprobs_under_noise_equal_the_trainers(device, compile):
    """End to end: the engine (prefill through the modules, decode through the glue, on CUDA compiled
    and replayed from CUDA graphs) samples under the noise that the trainer's teacher-forced forward
    sees in the same block, and without it once the block ends (the graphs captured under noise
    replay clean: they read the buffers, which are zeroed in place)."""
    torch.manual_seed(0)
    pol = random_policy(config("qwen2", max_position_embeddings=256), "bf16", lora_rank=4, device=device,
                        dtype=torch.float32, std=0.08, progress=False)
    m = pol.model
    aqn = AQN(m)  # before the engine captures graphs, as the trainer builds it
    eng = Engine(m, max_len=128, max_slots=4, sync_every=4, compile=compile)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 45))]
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=1)
    with aqn.applied(2e-2, seed=9):
        outs = eng.generate(prompts, n=2, params=p)
        noisy = [_teacher_forced(m, c) for c in outs]
    clean = [_teacher_forced(m, c) for c in outs]
    assert _worst(outs, noisy) < 1e-4 if device == "cpu" else _worst(outs, noisy) < 0.05 * _worst(outs, clean)
    assert _worst(outs, clean) > 1e-3
    outs = eng.generate(prompts, n=2, params=p)  # the same engine (and graphs), the noise gone
    assert _worst(outs, [_teacher_forced(m, c) for c in outs]) < 1e-4
    if device == "cuda":
        assert outs.stats.graphs_captured == 0 and eng.runner.graphs  # replayed the graphs captured under noise


def _worst(outs, ref):
    return max((torch.tensor(c.logprobs) - r.cpu()).abs().max().item() for c, r in zip(outs, ref))


def _teacher_forced(m, c):
    seq = torch.tensor([c.prompt_ids + c.token_ids], device=m.device)
    with torch.no_grad():
        lg = m(seq).logits[0, len(c.prompt_ids) - 1: -1].float()
    ids = torch.tensor(c.token_ids, device=m.device)[:, None]
    return torch.log_softmax(lg, -1).gather(-1, ids)[:, 0]


@CUDA
@pytest.mark.parametrize("sigma", SIGMAS)
def test_gpu_compiled_glue_in_a_cuda_graph_carries_every_sigma(sigma):
    """The GPU decode path: the torch.compile'd norm glue, captured in a CUDA graph before the noise
    is drawn, replayed with it: the noise reaching its output has the requested size (fp64
    reference), and with zero noise the output is the noise-free norm's within one rounding."""
    from qerl.rollout.forward import glue_ops

    model = _bf16_policy().cuda()
    aqn = AQN(model)
    view, ops = ModelView(model), glue_ops(True)
    g = torch.Generator(device="cuda").manual_seed(3)
    xs = {n: torch.randn(128, 512, device="cuda", generator=g).to(torch.bfloat16) for n in aqn.norms}
    outs = {}
    for _ in range(2):  # compile and warm up outside the graph
        outs = {n: _norm(view, ops, norm, xs[n]) for n, norm in aqn.norms.items()}
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {n: _norm(view, ops, norm, xs[n]) for n, norm in aqn.norms.items()}
    graph.replay()
    for n, norm in aqn.norms.items():
        # zero noise: within one bf16 rounding of the compiled noise-free norm and of HF's eager norm
        # (compiled kernels need not reduce or take rsqrt in the same order as eager CUDA, so not bit for bit)
        for ref in (ops["rms_norm"](xs[n], norm.weight, view.norm_eps[id(norm)]), type(norm).forward(norm, xs[n])):
            assert ((outs[n].float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-30).all()
    with aqn.applied(sigma, seed=5):
        graph.replay()
        gain, rel = _reach(aqn, {n: (xs[n], None) for n in xs}, lambda n, x: outs[n])
    assert rel == pytest.approx(sigma, rel=0.1)
    assert gain == pytest.approx(1.0, abs=0.1), (sigma, gain)
