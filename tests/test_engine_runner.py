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
