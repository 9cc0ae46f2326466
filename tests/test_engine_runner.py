"""The engine's parts: the scheduler's slot decisions (plain Python), chunked prefill, the FP8 KV cache."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl.rollout import Engine, SamplingParams
from qerl.rollout.scheduler import Scheduler
from tiny_models import config


def test_scheduler_prefills_a_group_once_then_copies_from_a_sibling():
    sch = Scheduler(4, prompt_lengths=[5, 7], n=3)
    a = sch.admit()
    assert a.slots == [0, 1, 2, 3]
    assert a.prefill == {0: [0, 1, 2], 1: [3]} and a.copies == []  # one prefill per prompt, all its slots
    assert sch.released_prompts() == [0]  # all of prompt 0's samples are in flight
    assert sch.retire([1])[0].prompt == 0
    b = sch.admit()  # prompt 1's second sample: its prompt K/V is in slot 3
    assert b.slots == [1] and b.copies == [(3, 1, 7)] and b.prefill == {}
    sch.retire([1, 3])  # prompt 1 has one sample left and none in flight ...
    c = sch.admit()
    assert c.prefill == {1: [1]} and c.copies == []  # ... so it is prefilled again
    assert not sch.waiting


def test_scheduler_buckets_and_compaction():
    sch = Scheduler(6, prompt_lengths=[3] * 6, n=1)
    sch.admit()
    sch.retire([0, 2, 3])
    assert sch.high() == 6 and sch.bucket() == 6  # bucket 8 capped at the slot count
    moves = sch.compaction()
    assert moves == [(5, 0), (4, 2)]  # highest live into lowest hole, until the live ones are a prefix
    assert [s is not None for s in sch.slots] == [True, True, True, False, False, False]
    assert sch.bucket() == 4 and sch.high() == 3


def _model(seed=0):
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config("qwen2", max_position_embeddings=256)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.08)
    return m


PROMPTS = [list(range(3, 40)), [5, 6, 7], list(range(50, 110))]


def test_chunked_prefill_matches_one_pass():
    m = _model()
    p = SamplingParams(max_new_tokens=12, greedy=True, ignore_eos=True)
    whole = Engine(m, max_len=128, max_slots=4, prefill_chunk_tokens=4096).generate(PROMPTS, n=2, params=p)
    chunked = Engine(m, max_len=128, max_slots=4, prefill_chunk_tokens=8).generate(PROMPTS, n=2, params=p)
    for a, b in zip(whole, chunked):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_fp8_kv_cache_stays_close_to_full_precision():
    """An E4M3 cache changes each K/V value by at most 2^-4 relative: greedy text and logprobs barely move."""
    m = _model(1)
    p = SamplingParams(max_new_tokens=24, greedy=True, ignore_eos=True)
    full = Engine(m, max_len=128, max_slots=4).generate(PROMPTS, n=1, params=p)
    eng = Engine(m, max_len=128, max_slots=4, kv_cache_dtype="fp8")
    assert eng.cache.fp8 and eng.cache.k[0].dtype == torch.float8_e4m3fn
    fp8 = eng.generate(PROMPTS, n=1, params=p)
    same = sum(a == b for x, y in zip(full, fp8) for a, b in zip(x.token_ids, y.token_ids))
    assert same >= 0.9 * sum(len(x.token_ids) for x in full)
    # the same tokens, scored under the fp8 cache: logprobs within a few hundredths of a nat
    d = [abs(a - b) for x, y in zip(full, fp8) for a, b in zip(x.logprobs, y.logprobs)][:5]
    assert max(d) < 0.05


def test_engine_refuses_an_unknown_kv_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(_model(), max_len=64, max_slots=2, kv_cache_dtype="int8")


# ---- multi-turn: a tool's output appended into the slot, decoding resumed --------------------------------
class _Tool:
    def __init__(self, stop, out, max_turns=1):
        self.stop, self.out, self.max_turns, self.calls = [stop], out, max_turns, []

    def respond(self, prompt_index, sample_index, token_ids, text):
        self.calls.append((prompt_index, sample_index, list(token_ids), text))
        return self.out


def _tool_setup():
    from tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    torch.manual_seed(3)
    m = AutoModelForCausalLM.from_config(config("qwen2", vocab_size=99, max_position_embeddings=256)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.4)  # large enough that greedy text does not collapse to one repeated character
    return m, tok


def test_multi_turn_appends_tool_output_and_continues_as_a_fresh_prompt_would():
    m, tok = _tool_setup()
    prompt = tok("user: add\nassistant: ", add_special_tokens=False)["input_ids"]
    p = SamplingParams(max_new_tokens=40, greedy=True, ignore_eos=True)
    single = Engine(m, tok, max_len=160, max_slots=2, sync_every=4).generate([prompt], params=p)[0]
    text = tok.decode(single.token_ids)
    k = next(i for i in range(3, len(text)) if text[i] not in text[:i])  # a character first seen at k
    tool_ids = tok("=42;", add_special_tokens=False)["input_ids"]
    handler = _Tool(text[k], tool_ids)
    multi = Engine(m, tok, max_len=160, max_slots=2, sync_every=4).generate([prompt], params=p, turns=handler)[0]
    c = k + 1  # the call's last token
    assert len(handler.calls) == 1 and handler.calls[0][2] == single.token_ids[:c]
    assert handler.calls[0][3].endswith(text[k])
    assert multi.token_ids[:c] == single.token_ids[:c]
    assert multi.token_ids[c:c + len(tool_ids)] == tool_ids and multi.tool_spans == [(c, c + len(tool_ids))]
    assert multi.logprobs[c:c + len(tool_ids)] == [0.0] * len(tool_ids)
    assert multi.model_token_mask() == [True] * c + [False] * len(tool_ids) + [True] * (40 - c - len(tool_ids))
    assert len(multi.token_ids) == 40 and multi.finish_reason == "length"
    # the independent reference: a fresh single-turn run whose prompt is everything up to the tool output
    head = multi.token_ids[:c + len(tool_ids)]
    rest = Engine(m, tok, max_len=160, max_slots=2).generate(
        [prompt + head], params=SamplingParams(max_new_tokens=40 - len(head), greedy=True, ignore_eos=True))[0]
    assert multi.token_ids[len(head):] == rest.token_ids
    assert max(abs(a - b) for a, b in zip(multi.logprobs[len(head):], rest.logprobs)) < 1e-4
    assert max(abs(a - b) for a, b in zip(multi.logprobs[:c], single.logprobs[:c])) < 1e-5


def test_multi_turn_handler_can_end_the_sample_and_turns_are_bounded():
    m, tok = _tool_setup()
    prompt = tok("user: go\nassistant: ", add_special_tokens=False)["input_ids"]
    p = SamplingParams(max_new_tokens=30, greedy=True, ignore_eos=True)
    text = tok.decode(Engine(m, tok, max_len=128, max_slots=1).generate([prompt], params=p)[0].token_ids)
    k = next(i for i in range(3, len(text)) if text[i] not in text[:i])
    ended = Engine(m, tok, max_len=128, max_slots=1, sync_every=4).generate([prompt], params=p,
                                                                             turns=_Tool(text[k], None))[0]
    assert ended.finish_reason == "stop" and len(ended.token_ids) == k + 1 and ended.tool_spans == []
    # a tool that always answers with the stop character itself would loop forever without max_turns
    loop = _Tool(text[k], tok(text[k], add_special_tokens=False)["input_ids"], max_turns=3)
    out = Engine(m, tok, max_len=128, max_slots=1, sync_every=4).generate([prompt], params=p, turns=loop)[0]
    assert len(loop.calls) <= 3 and len(out.tool_spans) == len(loop.calls)


def test_stop_id_buffers_are_refilled_in_place():
    """A captured decode graph reads eos_t/stop_t by address: setup() refills, never re-creates, them."""
    from qerl.rollout.model_runner import MAX_STOP_IDS

    run = Engine(_model(), max_len=32, max_slots=2).runner
    ptrs = (run.eos_t.data_ptr(), run.stop_t.data_ptr())
    run.setup(SamplingParams(max_new_tokens=4, stop_token_ids=[7, 9]), [1, 2])
    assert (run.eos_t.data_ptr(), run.stop_t.data_ptr()) == ptrs
    assert run.eos_t[:3].tolist() == [1, 2, -1] and run.stop_t[:3].tolist() == [7, 9, -1]
    run.setup(SamplingParams(max_new_tokens=4, ignore_eos=True), [1, 2])
    assert (run.eos_t == -1).all() and (run.stop_t == -1).all()
    assert (run.eos_t.data_ptr(), run.stop_t.data_ptr()) == ptrs
    with pytest.raises(ValueError, match="stop token ids"):
        run.setup(SamplingParams(max_new_tokens=4, stop_token_ids=list(range(MAX_STOP_IDS + 1))), [1])


def test_warmup_captures_under_the_engines_kernel_settings(monkeypatch):
    """Graphs bake in the kernel choices made while they are captured: warmup must run under the engine's
    KernelSettings, not the caller's (it ran under the caller's, so an engine with humming off captured
    humming's kernels)."""
    from qerl.kernels import settings
    from qerl.kernels.settings import KernelSettings

    eng = Engine(_model(), max_len=256, max_slots=2, kernel_settings=KernelSettings(humming=False, fuse_lora=False))
    seen = []
    monkeypatch.setattr(eng.runner, "cuda_graphs", True)
    monkeypatch.setattr(eng.runner, "step", lambda b, keys, p: seen.append(settings.current()))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # a CPU run of the GPU-only path
    assert settings.current().humming  # the caller's defaults
    eng.warmup([1])
    assert seen and all(not s.humming and not s.fuse_lora for s in seen)
    assert settings.current().humming  # and the caller's settings are back after it
