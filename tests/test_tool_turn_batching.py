"""Tool turns batched across samples (issue 35 §3), on the CPU.

The answers of one sync go through the model in one padded forward, and (for a handler that takes
concurrent calls) tools run on worker threads while the other samples keep decoding. Neither may
change a single token: every sample's tokens and logprobs are compared with the same rollout run
one sample at a time (one slot: every continuation a forward of its own, the path before batching),
with keyed seeded sampling, whose draws depend on the sample alone.
"""

import threading
import time

import pytest
import torch
from test_engine_runner import _tool_setup

from qerl.rollout import Engine, SamplingParams


class Calc:
    """Answers every call with a tool output whose length depends on the sample (so the batched
    continuations have different lengths and start positions), up to max_turns calls a sample."""

    def __init__(self, stop, tok, *, max_turns=3, concurrent=False, delay=0.0, fail_on=None):
        self.stop, self.max_turns, self.concurrent = [stop], max_turns, concurrent
        self.tok, self.delay, self.fail_on = tok, delay, fail_on
        self.calls = []
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0

    def respond(self, prompt_index, sample_index, token_ids, text):
        with self.lock:
            self.calls.append((prompt_index, sample_index, len(token_ids)))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fail_on is not None and len(self.calls) == self.fail_on:
                raise RuntimeError("tool handler broke")
            if self.delay:
                time.sleep(self.delay * (1 + sample_index % 3))
            return self.tok(f"={prompt_index * 7 + sample_index};" * (1 + sample_index % 3),
                            add_special_tokens=False)["input_ids"]
        finally:
            with self.lock:
                self.in_flight -= 1


def _setup():
    m, tok = _tool_setup()
    prompts = [tok(f"user: sum {i}\nassistant: ", add_special_tokens=False)["input_ids"] for i in range(3)]
    p = SamplingParams(max_new_tokens=48, temperature=1.0, seed=7, ignore_eos=True)
    # the stop character: one the model writes early in most samples (so several calls share a sync)
    probe = Engine(m, tok, max_len=200, max_slots=12, sync_every=4).generate(prompts, n=4, params=p)
    counts = {}
    for c in probe:
        for ch in set(tok.decode(c.token_ids)[2:20]):
            counts[ch] = counts.get(ch, 0) + 1
    stop = max(sorted(counts), key=counts.get)
    return m, tok, prompts, p, stop


def _run(m, tok, prompts, p, handler, slots, sync_every=4):
    eng = Engine(m, tok, max_len=200, max_slots=slots, sync_every=sync_every)
    return eng.generate(prompts, n=4, params=p, turns=handler)


def _same(a, b):
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.tool_spans == y.tool_spans and x.finish_reason == y.finish_reason
        assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4


def test_batched_continuations_equal_one_sample_at_a_time(monkeypatch):
    from qerl.rollout.model_runner import ModelRunner

    m, tok, prompts, p, stop = _setup()
    one = _run(m, tok, prompts, p, Calc(stop, tok), slots=1)
    sizes = []
    real = ModelRunner.continue_with
    monkeypatch.setattr(ModelRunner, "continue_with", lambda self, items, p: sizes.append(len(items)) or real(self, items, p))
    batched = _run(m, tok, prompts, p, Calc(stop, tok), slots=12)
    assert max(sizes) > 1  # several samples' tool outputs went through one forward
    assert sum(len(c.tool_spans) for c in one) >= 6  # the test exercises many tool turns
    _same(batched, one)


def test_concurrent_tools_beside_decoding_change_nothing():
    m, tok, prompts, p, stop = _setup()
    ref = _run(m, tok, prompts, p, Calc(stop, tok), slots=12)
    h = Calc(stop, tok, concurrent=True, delay=0.02)
    out = _run(m, tok, prompts, p, h, slots=12)
    _same(out, ref)
    assert h.max_in_flight > 1  # calls really overlapped
    assert len(set(h.calls)) == len(h.calls) == sum(len(c.tool_spans) for c in out)  # each call once


def test_a_handler_error_in_a_worker_reaches_the_caller():
    m, tok, prompts, p, stop = _setup()
    with pytest.raises(RuntimeError, match="tool handler broke"):
        _run(m, tok, prompts, p, Calc(stop, tok, concurrent=True, fail_on=3), slots=12)


def test_the_schedule_not_the_tools_speed_decides_when_answers_join():
    """Unseeded sampling draws from one stream in step order (as a GPU's graphs do): tools that answer
    fast or slow, in any order, must still give the same rollout."""
    m, tok, prompts, _, stop = _setup()
    p = SamplingParams(max_new_tokens=48, temperature=1.0, ignore_eos=True)  # no seed: the global stream
    outs = []
    for delay in (0.0, 0.03):
        torch.manual_seed(11)
        outs.append(_run(m, tok, prompts, p, Calc(stop, tok, concurrent=True, delay=delay), slots=12))
    assert sum(len(c.tool_spans) for c in outs[0]) >= 4
    _same(outs[1], outs[0])
