"""The rollout engine against Hugging Face generate and against exact distributions."""

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl.kernels import dispatch
from qerl.rollout import Engine, SamplingParams, processed_logprobs
from tiny_models import config

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(20, 45)), [3]]


def _model(family, seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config(family, max_position_embeddings=256, **kw)).to(dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.08)
    return m


def _hf_greedy(m, prompt, k):
    """HF greedy with EOS ignored (no EOS id at all: min_new_tokens would instead mask EOS's logit)."""
    gc = copy.deepcopy(m.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = [], 0, False
    # each weight dequantized once, not at every token (the nvfp4 case's 47 s): HF's own loop stays the reference
    with dispatch.dequantized_cache():
        out = m.generate(torch.tensor([prompt], device=m.device), generation_config=gc, max_new_tokens=k)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("max_slots", [1, 3, 16])
def test_greedy_equals_hf_generate(family, max_slots):
    """Batched (prompts of different lengths, several samples each) and one slot at a time."""
    m = _model(family)
    eng = Engine(m, max_len=128, max_slots=max_slots, sync_every=4)
    outs = eng.generate(PROMPTS, n=2, params=SamplingParams(max_new_tokens=32, greedy=True, ignore_eos=True))
    assert len(outs) == len(PROMPTS) * 2
    for c in outs:
        assert c.prompt_ids == PROMPTS[c.prompt_index]
        assert c.token_ids == _hf_greedy(m, c.prompt_ids, 32), (c.prompt_index, c.sample_index)
        assert c.finish_reason == "length" and len(c.logprobs) == 32
    assert outs.stats.max_batch <= max_slots


def test_quantized_policy_greedy_equals_hf_on_the_same_module(tmp_path):
    """The engine runs the policy's own QLoRALinear modules: HF generate on that model agrees."""
    from qerl.model import load_policy
    from tiny_models import save_tiny

    save_tiny(tmp_path / "m", "qwen2", dtype=torch.float32)
    pol = load_policy(str(tmp_path / "m"), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False)
    for n, p in pol.model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.2)  # a live adapter, so its expand is exercised
    eng = Engine(pol.model, max_len=96, max_slots=4, sync_every=8)
    outs = eng.generate(PROMPTS[:3], n=1, params=SamplingParams(max_new_tokens=32, greedy=True, ignore_eos=True))
    for c in outs:
        assert c.token_ids == _hf_greedy(pol.model, c.prompt_ids, 32)


def test_eos_and_length_and_continuous_batching_refill():
    m = _model("llama")
    eng = Engine(m, max_len=128, max_slots=2, sync_every=2)
    ref = {i: _hf_greedy(m, p, 24) for i, p in enumerate(PROMPTS)}
    # a token the first prompt emits first at step k >= 3: it must stop there, with reason eos
    k = next(i for i in range(3, 24) if ref[0][i] not in ref[0][:i])
    eos = ref[0][k]
    m.generation_config.eos_token_id = eos
    outs = eng.generate(PROMPTS, n=1, params=SamplingParams(max_new_tokens=24, greedy=True))
    for c in outs:
        r = ref[c.prompt_index]
        if eos in r:
            cut = r.index(eos) + 1
            assert c.token_ids == r[:cut] and c.finish_reason == "eos"
        else:
            assert c.token_ids == r and c.finish_reason == "length"
    assert outs[0].finish_reason == "eos" and len(outs[0].token_ids) == k + 1


def test_max_len_ends_with_length():
    m = _model("llama")
    eng = Engine(m, max_len=40, max_slots=4, sync_every=4)
    (c,) = eng.generate([PROMPTS[2]], params=SamplingParams(max_new_tokens=40, greedy=True, ignore_eos=True))
    assert len(PROMPTS[2]) + len(c.token_ids) == 40 and c.finish_reason == "length"
    assert c.token_ids == _hf_greedy(m, PROMPTS[2], len(c.token_ids))


def test_stop_string_truncates_after_it():
    class Tok:  # each id decodes to one letter
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i % 26) for i in ids)

    m = _model("llama")
    eng = Engine(m, Tok(), max_len=128, max_slots=4, sync_every=4)
    ref = _hf_greedy(m, PROMPTS[0], 30)
    stop = Tok().decode(ref[7:9])
    (c,) = eng.generate([PROMPTS[0]], params=SamplingParams(max_new_tokens=30, greedy=True, stop=[stop]))
    text = Tok().decode(ref)
    cut = text.index(stop) + len(stop)
    assert c.finish_reason == "stop" and c.token_ids == ref[:cut] and c.text.endswith(stop)


def test_logprobs_match_a_teacher_forced_forward():
    """What the trainer computes: log_softmax(logits / T) of the full sequence at each sampled token."""
    m = _model("qwen2")
    eng = Engine(m, max_len=128, max_slots=8, sync_every=4)
    T = 0.7
    outs = eng.generate(PROMPTS, n=3, params=SamplingParams(max_new_tokens=20, temperature=T, seed=1))
    worst = 0.0
    for c in outs:
        seq = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            lg = m(seq).logits[0, len(c.prompt_ids) - 1: -1].float()
        ref = torch.log_softmax(lg / T, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    assert worst < 1e-4


def test_sampling_is_seeded_and_samples_differ():
    m = _model("llama")
    eng = Engine(m, max_len=64, max_slots=8)
    p = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    a = [c.token_ids for c in eng.generate([PROMPTS[0]], n=4, params=p)]
    b = [c.token_ids for c in eng.generate([PROMPTS[0]], n=4, params=p)]
    assert a == b and len({tuple(x) for x in a}) > 1


@pytest.mark.parametrize("top_p,top_k,temp", [(1.0, 0, 1.0), (1.0, 0, 0.5), (0.7, 0, 1.0), (1.0, 5, 1.3), (0.9, 8, 0.8)])
def test_sampler_draws_from_the_specified_distribution(top_p, top_k, temp):
    """Chi-square of 40k draws against the temperature / top-k / top-p distribution built directly."""
    from qerl.rollout.sampling import sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 24, generator=g) * 2
    p = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k)
    # independent reference, in Hugging Face's warper order: temperature, keep the top-k,
    # renormalize, keep the smallest prefix of them with mass >= top_p
    probs = torch.softmax(logits[0].double() / temp, -1)
    order = torch.argsort(probs, descending=True).tolist()
    order = order[:top_k] if top_k else order
    probs_k = torch.zeros(24, dtype=torch.float64)
    probs_k[order] = probs[order] / probs[order].sum()
    keep = torch.zeros(24, dtype=torch.bool)
    mass = 0.0
    for i in order:
        if mass >= top_p:
            break
        keep[i] = True
        mass += probs_k[i].item()
    want = torch.where(keep, probs, 0)
    want = want / want.sum()
    got = processed_logprobs(logits, p)[0].double().exp()
    assert torch.allclose(got, want, atol=1e-6)
    n = 40000
    toks, lps = sample(logits.expand(n, -1), p, torch.Generator().manual_seed(1))
    assert keep[toks].all()
    counts = torch.bincount(toks, minlength=24).double()
    exp = want * n
    m = exp > 0
    chi2 = (((counts - exp) ** 2)[m] / exp[m]).sum().item()
    dof = int(m.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * max(dof, 1)) + 5
    assert torch.allclose(lps.double(), want[toks].log(), atol=1e-5)


def test_perturb_context_is_entered_and_exited():
    m = _model("llama")
    w = m.model.norm.weight
    orig = w.detach().clone()
    seen = {}

    class Noise:
        def __enter__(self):
            w.data.add_(1.0)
            seen["in"] = True

        def __exit__(self, *a):
            w.data.copy_(orig)

    eng = Engine(m, max_len=64, max_slots=4)
    p = SamplingParams(max_new_tokens=8, greedy=True, ignore_eos=True)
    noisy = eng.generate([PROMPTS[0]], params=p, perturb=Noise())[0].token_ids
    clean = eng.generate([PROMPTS[0]], params=p)[0].token_ids
    assert seen["in"] and torch.equal(w, orig)
    assert clean == _hf_greedy(m, PROMPTS[0], 8)
    assert len(noisy) == 8


def test_bad_input_is_named():
    m = _model("llama")
    eng = Engine(m, max_len=32, max_slots=2)
    with pytest.raises(ValueError, match="prompt 1 has 40 tokens"):
        eng.generate([[1, 2], list(range(40))])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        eng.generate([[]])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="KV cache budget"):
        Engine(m, max_len=32, kv_cache_gb=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["bf16", "nvfp4"])
def test_smollm2_greedy_equals_hf_generate(quant):
    """The offline default model: chat-templated prompts of different lengths, batched and one at a time."""
    from qerl.model import load_policy

    pol = load_policy("smollm2", quant, lora_rank=0, dtype=torch.float32, progress=False)
    tok = pol.tokenizer
    qs = ["What is 12 times 7?", "Name three prime numbers greater than 50 and explain why they are prime.", "Hi"]
    ids = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
           for q in qs]
    ids = [list(x["input_ids"]) if hasattr(x, "keys") else list(x) for x in ids]
    p = SamplingParams(max_new_tokens=32, greedy=True, ignore_eos=True)
    batched = Engine(pol.model, tok, max_len=256, max_slots=8).generate(ids, params=p)
    single = Engine(pol.model, tok, max_len=256, max_slots=1).generate(ids, params=p)
    for b, s in zip(batched, single):
        ref = _hf_greedy(pol.model, b.prompt_ids, 32)
        assert b.token_ids == ref and s.token_ids == ref


def test_compiled_decode_glue_equals_eager():
    """torch.compile'd decode glue (the GPU default) gives the same greedy tokens as the eager glue."""
    m = _model("qwen3")
    g = SamplingParams(max_new_tokens=16, greedy=True, ignore_eos=True)
    a = Engine(m, max_len=128, max_slots=8, compile=True).generate(PROMPTS, n=2, params=g)
    b = Engine(m, max_len=128, max_slots=8, compile=False).generate(PROMPTS, n=2, params=g)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
