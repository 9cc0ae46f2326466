"""The rollout engine on CUDA: CUDA-graph decode against HF generate and against eager steps."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from test_rollout import PROMPTS, _hf_greedy, _model  # noqa: E402

from qerl.model import qwen25_config, random_policy  # noqa: E402
from qerl.rollout import Engine, SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=32, greedy=True, ignore_eos=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_graph_decode_greedy_equals_hf_fp32(family):
    m = _model(family).cuda()
    eng = Engine(m, max_len=128, max_slots=8, sync_every=4)
    outs = eng.generate(PROMPTS, n=2, params=GREEDY)
    assert outs.stats.graphs_captured > 0
    for c in outs:
        assert c.token_ids == _hf_greedy(m, c.prompt_ids, 32)


def _policy(quant):
    pol = random_policy(qwen25_config("qwen2.5-0.5b", 4), quant, lora_rank=16, device="cuda", std=0.05, progress=False)
    for n, p in pol.model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return pol


@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_graphs_equal_eager_and_logprobs_match_training_forward(quant):
    pol = _policy(quant)
    prompts = [list(range(100, 100 + L)) for L in (7, 30, 64)]
    a = Engine(pol.model, max_len=160, max_slots=24, sync_every=8).generate(prompts, n=6, params=GREEDY)
    b = Engine(pol.model, max_len=160, max_slots=24, cuda_graphs=False).generate(prompts, n=6, params=GREEDY)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    # Sampled logprobs: engine (bf16, fused small-M kernels) and the trainer's path (grad-enabled
    # forward: dequant + cuBLAS, unfused LoRA) against the same weights run in fp32. Both are bf16
    # approximations of that reference; the engine must be about as close to it as the trainer is.
    p = SamplingParams(max_new_tokens=48, temperature=1.0, seed=0, ignore_eos=True)
    outs = Engine(pol.model, max_len=160, max_slots=24).generate(prompts, n=4, params=p)
    ref = random_policy(qwen25_config("qwen2.5-0.5b", 4), quant, lora_rank=16, device="cuda", dtype=torch.float32,
                        progress=False)
    ref.model.load_state_dict(pol.model.state_dict())

    def logprobs(model, c):
        seq = torch.tensor([c.prompt_ids + c.token_ids], device="cuda")
        with torch.enable_grad():
            lg = model(seq).logits[0, len(c.prompt_ids) - 1: -1].float().detach()
        return torch.log_softmax(lg, -1).gather(-1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0]

    eng = torch.cat([torch.tensor(c.logprobs, device="cuda") for c in outs])
    train = torch.cat([logprobs(pol.model, c) for c in outs])
    exact = torch.cat([logprobs(ref.model, c) for c in outs])
    d_et, d_e, d_t = (eng - train).abs(), (eng - exact).abs(), (train - exact).abs()
    print(f"{quant}: logprob |engine - trainer| mean {d_et.mean():.4f} max {d_et.max():.4f}; vs fp32: "
          f"engine {d_e.mean():.4f}, trainer {d_t.mean():.4f}")
    assert d_e.mean() <= 1.5 * d_t.mean() + 0.005 and d_et.max() < 0.5


def test_seeded_graph_sampling_repeats():
    pol = _policy("nvfp4")
    eng = Engine(pol.model, max_len=96, max_slots=8)
    p = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    x = [c.token_ids for c in eng.generate([PROMPTS[2]], n=4, params=p)]
    y = [c.token_ids for c in eng.generate([PROMPTS[2]], n=4, params=p)]
    assert x == y and len({tuple(t) for t in x}) > 1


def test_alternating_sampling_settings_reuse_their_graphs():
    """Training and evaluation alternate settings (T=1 vs T=0.6, top-p): each keeps its graphs, and
    a setting's seeded samples are the same before and after the other ran (this used to trip the
    CUDA caching allocator when the first setting's graphs were dropped)."""
    pol = _policy("nvfp4")
    eng = Engine(pol.model, max_len=96, max_slots=8)
    a = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    b = SamplingParams(max_new_tokens=24, temperature=0.6, top_p=0.95, seed=5, ignore_eos=True)
    xa = [c.token_ids for c in eng.generate([PROMPTS[2]], n=4, params=a)]
    xb = [c.token_ids for c in eng.generate([PROMPTS[2]], n=4, params=b)]
    n = len(eng.runner.graphs)
    assert xa == [c.token_ids for c in eng.generate([PROMPTS[2]], n=4, params=a)]
    assert xb == [c.token_ids for c in eng.generate([PROMPTS[2]], n=4, params=b)]
    assert len(eng.runner.graphs) == n  # nothing recaptured


def test_graphs_read_the_current_eos_and_stop_ids():
    """Graphs captured by warmup() must keep reading the EOS/stop ids of later rollouts. They were
    once re-created per rollout, so a replay read freed memory and ended samples at random tokens."""
    pol = _policy("nvfp4")
    eng = Engine(pol.model, max_len=160, max_slots=8)
    p = SamplingParams(max_new_tokens=128, temperature=1.0, seed=3, ignore_eos=True)
    eng.warmup([8], p)
    V = pol.model.config.vocab_size
    junk = [torch.full((1,), t, dtype=torch.long, device="cuda") for t in range(0, V, max(1, V // 4096))]  # noqa: F841
    outs = eng.generate([PROMPTS[0], PROMPTS[1]], n=4, params=p)
    assert [len(c.token_ids) for c in outs] == [128] * 8
    # a stop id set after capture is honoured by the same graphs
    stop = outs[0].token_ids[5]
    q = SamplingParams(max_new_tokens=128, temperature=1.0, seed=3, ignore_eos=False, stop_token_ids=[stop])
    again = eng.generate([PROMPTS[0], PROMPTS[1]], n=4, params=q)
    assert len(again[0].token_ids) <= 6 and again[0].token_ids[-1] == stop


def test_two_engines_replaying_at_once_agree_with_each_alone():
    """Each engine captures on its own stream, so its kernels' split-K counters are its own (kernels/counters.py):
    two engines' graphs replayed at once on two streams give what each gives alone."""
    from qerl.kernels import counters

    pol = _policy("nvfp4")
    prompts = [list(range(100, 107 + i % 50)) for i in range(64)]  # decode M = 64: the wgmma path
    alone = Engine(pol.model, max_len=160, max_slots=64).generate(prompts, n=1, params=GREEDY)
    e1, e2 = Engine(pol.model, max_len=160, max_slots=64), Engine(pol.model, max_len=160, max_slots=64)
    e1.generate(prompts, n=1, params=GREEDY), e2.generate(prompts, n=1, params=GREEDY)  # capture both
    assert e1.runner._capture_stream.cuda_stream != e2.runner._capture_stream.cuda_stream
    keys = {k for k in counters._BUFS if k[1] in (e1.runner._capture_stream.cuda_stream, e2.runner._capture_stream.cuda_stream)}
    assert len(keys) == 2
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    out = {}
    for name, e, s in (("a", e1, s1), ("b", e2, s2)):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            out[name] = e.generate(prompts, n=1, params=GREEDY)
    torch.cuda.synchronize()
    for name in out:
        assert [c.token_ids for c in out[name]] == [c.token_ids for c in alone]


def test_the_4bit_embedding_in_graphs_equals_eager_and_the_dequantized_table():
    """embed_4bit (layers/quant_embed.py): the lookup is captured in the decode graphs (no host copy) and gives
    the tokens an nn.Embedding holding its dequantized table gives."""
    from qerl.layers.quant_embed import quantize_embedding

    cfg = qwen25_config("qwen2.5-0.5b", 4)
    cfg.tie_word_embeddings = False  # (a tied table is refused: the head keeps it)
    pol, ref = (random_policy(cfg, "nvfp4", lora_rank=16, device="cuda", std=0.05, progress=False) for _ in "ab")
    ref.model.load_state_dict(pol.model.state_dict())
    q = quantize_embedding(pol.model)
    with torch.no_grad():
        ref.model.get_input_embeddings().weight.copy_(q.weight)
    prompts = [list(range(100, 100 + L)) for L in (7, 30, 64)]
    a = Engine(pol.model, max_len=160, max_slots=24, sync_every=8).generate(prompts, n=6, params=GREEDY)
    assert a.stats.graphs_captured > 0
    b = Engine(pol.model, max_len=160, max_slots=24, cuda_graphs=False).generate(prompts, n=6, params=GREEDY)
    r = Engine(ref.model, max_len=160, max_slots=24, sync_every=8).generate(prompts, n=6, params=GREEDY)
    assert [c.token_ids for c in a] == [c.token_ids for c in b] == [c.token_ids for c in r]
