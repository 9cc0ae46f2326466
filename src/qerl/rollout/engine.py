"""The rollout engine: continuous batching over a static slot cache, on the live policy.

    engine = Engine(policy.model, policy.tokenizer, max_len=2048)
    outs = engine.generate(prompts, n=8, params=SamplingParams(max_new_tokens=512, temperature=1.0))

The loop below is all there is: the scheduler (plain Python) decides which sample sits in
which slot; the model runner owns the tensors, prefill, the decode step and its CUDA graphs.
Each prompt is prefilled once; its n samples get the prompt's K/V copied into their slots (a
sample admitted later copies it from a sibling still in flight, or the prompt is prefilled
again). The host looks at the state only every `sync_every` steps (16 on a GPU, every step on
the CPU): it retires finished slots, admits waiting samples into free ones and compacts the tail
into holes, so short and long completions don't hold each other back. On a GPU the decode batch
is a bucket (one CUDA graph each); on the CPU it is exactly the live slots.
"""

from __future__ import annotations

import contextlib
import operator
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..completion import Completion
from ..device_memory import free_bytes
from ..kernels import dispatch, settings
from ..kernels.experts_path import gemv_max_tokens
from ..kernels.settings import KernelSettings
from .forward import ModelView
from .kv_cache import slots_for_budget
from .model_runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import BUCKETS, Scheduler
from .turns import TurnHandler

SCAN_OVERLAP = 32  # tokens re-decoded before the new ones when scanning for stop strings
TOOL_WORKERS = 16  # tool calls run at once, where the turn handler allows concurrent calls


@dataclass
class RolloutStats:
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: int = 0
    graphs_captured: int = 0
    max_batch: int = 0
    # (decode batch bucket, key bucket, ms per step) of each stretch of sync_every steps, timed host to
    # host across the sync that ends it: where a long rollout's time goes
    chunks: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


class Completions(list):
    """What `Engine.generate` returns: the completions (a list, prompt-major) and that call's stats."""

    def __init__(self, items, stats: RolloutStats):
        super().__init__(items)
        self.stats = stats


@dataclass
class _Pending:
    """A tool call running beside the decoding: its sample (held out of decoding), its call's end."""
    seq: object  # the scheduler's Sequence (its slot may move in a compaction)
    call_end: int
    future: Future


@dataclass
class _Call:
    """One `generate` call's own state, passed down its loop (the engine instance keeps none)."""
    params: SamplingParams
    turns: TurnHandler | None
    limits: list[list[int]] | None  # each sample's limit of new tokens (SamplingParams), or None
    stats: RolloutStats = field(default_factory=RolloutStats)
    pool: ThreadPoolExecutor | None = None  # tool calls, where the handler takes concurrent calls
    pending: dict[int, _Pending] = field(default_factory=dict)  # id(sequence) -> its running tool call
    # the requests: prompts' token ids, their keys, samples per prompt, and the scheduler over them
    ids: list = field(default_factory=list)
    keys: list = field(default_factory=list)
    n: int = 1
    sched: Scheduler | None = None
    logits_of: dict = field(default_factory=dict)  # slot -> its prefill's last logits, until it starts
    results: dict = field(default_factory=dict)  # (prompt, sample) -> Completion
    bar: object = None


# MoE decode from CUDA graphs by default: the expert LoRA runs in graph-safe kernels (kernels/moe_lora.py), and
# tests/test_moe_gpu.py's graph tests pass on an H100 (graphs give eager's bits).
MOE_GRAPHS_DEFAULT = True


class Engine:
    def __init__(self, model, tokenizer=None, *, max_len: int = 2048, max_slots: int = 256,
                 kv_cache_gb: float | None = None, cuda_graphs: bool | None = None, sync_every: int | None = None,
                 prefill_tokens: int = 8192, cache_dequantized: bool | None = None, compile: bool | None = None,
                 kv_cache_dtype: str = "auto", fused_attention: bool | None = None, prefill_chunk_tokens: int = 2048,
                 kernel_settings: KernelSettings | None = None):
        """max_len: prompt + completion tokens a slot holds. kv_cache_gb: the cache's budget (default:
        half the free GPU memory, 1 GiB on the CPU); kv_cache_dtype: auto (the model's) | fp8 (E4M3,
        per-head scales: half the bytes). prefill_tokens: padded prompt tokens per prefill batch;
        prefill_chunk_tokens: tokens per attention/MLP chunk inside it (bounds prefill memory).
        cuda_graphs / compile / fused_attention / cache_dequantized: None picks by device.
        kernel_settings: the kernel choices its rollouts run under (None: the caller's, kernels.settings)."""
        self.kernel_settings = kernel_settings
        self.view = ModelView(model)
        self.model, self.tokenizer = model, tokenizer
        dev = self.view.device
        # host syncs: every 16 steps on a GPU (a sync stalls the queue of replayed graphs); on the CPU there
        # is nothing to stall, so finished slots retire and the batch shrinks after every step
        if sync_every is None:
            sync_every = 16 if dev.type == "cuda" else 1
        self.max_len, self.sync_every, self.prefill_tokens = max_len, sync_every, prefill_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if kv_cache_gb is None:  # half of what is free now on a GPU (under a memory cap); 1 GiB on the CPU
            kv_cache_gb = free_bytes(dev) * 0.5 / 2**30 if dev.type == "cuda" else 1.0
        self.n_slots = slots_for_budget(self.view, max_len, int(kv_cache_gb * 2**30), max_slots, kv_cache_dtype)
        cuda = dev.type == "cuda"
        moe = self.view.family.experts is not None
        self.runner = ModelRunner(self.view, self.n_slots, max_len, kv_cache_dtype=kv_cache_dtype,
                                  # an MoE's decode is capturable only where the grouped GEMV runs it (the loop
                                  # and the grouped path read the routing on the host): graphs bounded by it
                                  cuda_graphs=(cuda and (MOE_GRAPHS_DEFAULT or not moe)) if cuda_graphs is None
                                  else cuda_graphs,
                                  graph_max_batch=gemv_max_tokens(kernel_settings) if moe else None,
                                  compile=cuda if compile is None else compile, fused_attention=fused_attention)
        self.cache = self.runner.cache
        # graphs turned off by the caller on a GPU: this engine is the graphs' eager reference (Engine.step)
        self._graph_reference = cuda and cuda_graphs is False
        # without kernels (CPU), keep dequantized weights for the rollout's duration
        self.cache_dequantized = not cuda if cache_dequantized is None else cache_dequantized

    # ---- public ------------------------------------------------------------------------------
    def eos_ids(self) -> list[int]:
        ids = set()
        gc = getattr(self.model, "generation_config", None)
        for src in (getattr(gc, "eos_token_id", None), getattr(self.model.config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if src is not None:
                ids.update([src] if isinstance(src, int) else src)
        return sorted(ids)

    @torch.no_grad()
    def generate(self, prompts, n: int = 1, params: SamplingParams | None = None, *, perturb=None,
                 progress: bool = False, prompt_keys: list[int] | None = None,
                 turns: TurnHandler | None = None) -> Completions:
        """prompts: strings (tokenized as they are: apply a chat template first) or token-id lists.

        Returns len(prompts)·n completions, ordered by prompt then sample, with the call's
        RolloutStats as `.stats`. perturb: a context
        manager entered around the whole rollout (AQN's noise on the norm weights). On the CPU with
        a seed, sample j of prompt i draws from keyed_uniform(seed, prompt_keys[i]·n + j, position)
        (prompt_keys default to 0..len-1), so its tokens depend on neither batch nor slot.
        params.sample_max_new_tokens(prompt_keys[i], j), when set, is sample j's own limit of new tokens.
        turns: a multi-turn handler (rollout/turns.py): tool calls end a model turn, the tool's
        output is appended into the same slot and decoding resumes.
        """
        p = params or SamplingParams()
        if turns is not None and self.tokenizer is None:
            raise ValueError("multi-turn rollouts need the engine's tokenizer (to find the tool-call stop)")
        ids = [self._encode(x) for x in prompts]
        for i, x in enumerate(ids):
            if not x:
                raise ValueError(f"prompt {i} is empty")
            if len(x) >= self.max_len:
                raise ValueError(f"prompt {i} has {len(x)} tokens; the engine's max_len is {self.max_len}")
        keys = list(prompt_keys) if prompt_keys is not None else list(range(len(ids)))
        if len(keys) != len(ids):
            raise ValueError(f"{len(keys)} prompt_keys for {len(ids)} prompts")
        call = _Call(p, turns, self._sample_limits(p, keys, n), ids=ids, keys=keys, n=n,
                     sched=Scheduler(self.n_slots, [len(x) for x in ids], n))
        if turns is not None and getattr(turns, "concurrent", False):
            call.pool = ThreadPoolExecutor(TOOL_WORKERS, thread_name_prefix="qerl-tool")
        self._setup(p)
        t0, captured0 = time.perf_counter(), self.runner.graphs_captured
        call.bar = tqdm(total=len(call.sched.waiting), desc="rollout", unit="seq", disable=not progress)
        cache = dispatch.dequantized_cache() if self.cache_dequantized else contextlib.nullcontext()
        kernels = settings.use(self.kernel_settings) if self.kernel_settings is not None else contextlib.nullcontext()
        pool = call.pool if call.pool is not None else contextlib.nullcontext()
        with kernels, cache, pool, perturb if perturb is not None else contextlib.nullcontext():
            while call.sched.has_work():
                self.step(call)
        call.bar.close()
        if self.view.device.type == "cuda":
            # this stream only: a rollout beside the update (max_staleness 1) must not wait for its kernels
            torch.cuda.current_stream(self.view.device).synchronize()
        stats = call.stats
        stats.seconds = time.perf_counter() - t0
        stats.graphs_captured = self.runner.graphs_captured - captured0
        stats.new_tokens = sum(len(c.token_ids) for c in call.results.values())
        return Completions([call.results[(i, j)] for i in range(len(ids)) for j in range(n)], stats)

    def step(self, call: _Call) -> None:
        """One engine step of a call: schedule (admit waiting samples, pick the decode and key buckets), run
        sync_every decode steps, postprocess (retire finished samples, compact the slots)."""
        run, sched, stats = self.runner, call.sched, call.stats
        self._admit(call, sched, call.ids, call.keys, call.n, call.logits_of)
        hi = sched.high()
        b = sched.bucket()  # buckets bound the graphs; eager steps run what is live
        # ... except an engine built without graphs on a GPU, the graphs' reference: it runs the bucket too, since a
        # kernel's tiling (humming-kernels' config, cuBLAS's algorithm) may depend on M, and with it the bits.
        b = b if run.graphed(b) or self._graph_reference else hi
        stats.max_batch = max(stats.max_batch, hi)
        max_pos = max(sched.slots[s].length for s in sched.live(hi)) + run.max_count(hi)
        # keys in buckets of 128 bound the graphs (and a GPU's compiled eager steps); the CPU reads only the keys
        # there are, to a multiple of 8: attention over 128 keys where the default run's rows hold 55-103
        step = 8 if self.view.device.type == "cpu" else 128
        key_bucket = min(self.max_len, -(-(max_pos + self.sync_every + 1) // step) * step)
        tc = time.perf_counter()
        for _ in range(self.sync_every):
            run.step(b, key_bucket, call.params)
        stats.steps += self.sync_every
        call.bar.update(self._retire(call, sched, call.results, call.ids, hi))  # syncs: the chunk's steps are done
        stats.chunks.append((b, key_bucket, 1e3 * (time.perf_counter() - tc) / self.sync_every))
        if not sched.waiting:
            for src, dst in sched.compaction():
                run.move(src, dst)

    @torch.no_grad()
    def warmup(self, batch_sizes, params: SamplingParams | None = None, max_len: int | None = None) -> int:
        """Capture the decode graphs a rollout of these batch sizes will use (all key-length buckets),
        so that no capture lands inside a timed or latency-critical rollout. Returns graphs captured."""
        if not self.runner.cuda_graphs:
            return 0
        p = params or SamplingParams()
        self._setup(p)
        before = self.runner.graphs_captured
        top = min(max_len or self.max_len, self.max_len)
        # The graphs bake in the kernel choices made while capturing: capture under the engine's own settings.
        kernels = settings.use(self.kernel_settings) if self.kernel_settings is not None else contextlib.nullcontext()
        with kernels:
            for n in batch_sizes:
                b = min(next((x for x in BUCKETS if x >= n), self.n_slots), self.n_slots)
                if not self.runner.graphed(b):
                    continue
                for keys in range(128, top + 128, 128):
                    self.runner.step(b, min(keys, self.max_len), p)  # no slot is active: state is untouched
        torch.cuda.synchronize()
        return self.runner.graphs_captured - before

    # ---- internals ---------------------------------------------------------------------------
    def _encode(self, x) -> list[int]:
        if isinstance(x, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token ids instead")
            return self.tokenizer(x, add_special_tokens=False)["input_ids"]
        return [int(t) for t in x]

    @staticmethod
    def _sample_limits(p: SamplingParams, keys: list[int], n: int) -> list[list[int]] | None:
        """Each sample's own limit of new tokens, [prompt][sample], capped at max_new_tokens (None: no limits)."""
        f = p.sample_max_new_tokens
        if f is None:
            return None
        out = []
        for i, k in enumerate(keys):
            row = []
            for j in range(n):
                v = f(k, j)
                try:
                    lim = operator.index(v)  # ints, numpy and torch integers; not floats
                except TypeError:
                    lim = None
                if lim is None or lim < 1:
                    raise ValueError(f"sample_max_new_tokens gave {v!r} for prompt {i} (key {k}), sample {j}: "
                                     "each sample's limit must be an integer >= 1")
                row.append(min(lim, p.max_new_tokens))
            out.append(row)
        return out

    @staticmethod
    def _limit(call: _Call, seq) -> int:
        return call.limits[seq.prompt][seq.sample] if call.limits is not None else call.params.max_new_tokens

    def _setup(self, p: SamplingParams):
        if p.max_new_tokens > self.max_len:
            raise ValueError(f"max_new_tokens {p.max_new_tokens} exceeds the engine's max_len {self.max_len}")
        self.runner.setup(p, self.eos_ids())

    def _admit(self, call: _Call, sched: Scheduler, ids, keys, n, logits_of):
        p = call.params
        adm = sched.admit()
        if not adm.slots:
            return
        t0 = time.perf_counter()
        run = self.runner
        for src, dst, length in adm.copies:
            run.copy_prompt(src, dst, length)
        logits_of.update(run.prefill(adm.prefill, ids, self.prefill_tokens, self.prefill_chunk_tokens))
        seqs = [sched.slots[s] for s in adm.slots]
        run.start(adm.slots, torch.stack([logits_of[q.prompt] for q in seqs]),
                  [keys[q.prompt] * n + q.sample for q in seqs], [q.length for q in seqs], p,
                  [self._limit(call, q) for q in seqs])
        for pi in sched.released_prompts():
            del logits_of[pi]  # every sample of it is in flight: no one needs its logits again
        call.stats.prefill_seconds += time.perf_counter() - t0

    def _retire(self, call: _Call, sched: Scheduler, results, ids, hi) -> int:
        p = call.params
        done = self.runner.finished(hi)
        stop_hits, calls = {}, {}
        if self.tokenizer is not None and (p.stop or call.turns is not None):
            stop_hits, calls = self._scan(sched, hi, p.stop, call.turns.stop if call.turns is not None else [])
        if calls or call.pending:
            self._take_turns(call, sched, hi, done, stop_hits, calls)
            done = self.runner.finished(hi)
        fin = [s for s in sched.live(hi) if (done[s] or s in stop_hits) and id(sched.slots[s]) not in call.pending]
        if not fin:
            return 0
        counts, toks, lps, reasons = self.runner.tokens_of(fin)
        for r, (s, seq) in enumerate(zip(fin, sched.retire(fin))):
            c, reason = counts[r], reasons[r] if done[s] else "stop"
            if s in stop_hits and (not done[s] or stop_hits[s] < c):
                c, reason = stop_hits[s], "stop"
            tid = toks[r][:c]
            results[(seq.prompt, seq.sample)] = Completion(
                seq.prompt, seq.sample, ids[seq.prompt], tid, lps[r][:c], reason,
                self.tokenizer.decode(tid, skip_special_tokens=True) if self.tokenizer is not None else None,
                [(a, min(b, c)) for a, b in seq.tool_spans if a < c])
        self.runner.release(fin)
        return len(fin)

    def _take_turns(self, call: _Call, sched: Scheduler, hi, done, stop_hits, calls):
        """Slots whose current model turn ended in a tool call: run the handler, append its tokens.

        All the answers of one sync go through the model in one forward (`ModelRunner.continue_with`).
        Where the handler takes concurrent calls (`concurrent = True`), each call runs on a worker
        thread while the other samples keep decoding: its sample is held out of decoding and resumes at
        the next sync (at once when nothing else is left to decode)."""
        h = call.turns
        answered = []  # (slot, sequence, call end, tokens to append or None)
        due = list(call.pending.items())  # submitted at an earlier sync: answered now, whatever the timing
        for s, c in calls.items():
            seq = sched.slots[s]
            if id(seq) in call.pending:  # found again in the scan's overlap: already running
                continue
            if (s in stop_hits and stop_hits[s] <= c) or seq.turns >= h.max_turns:
                continue
            counts, toks, _, reasons = self.runner.tokens_of([s])
            if done[s] and counts[0] <= c:  # finished (EOS, length) at or before the call's end
                continue
            tid = toks[0][:c]
            args = (seq.prompt, seq.sample, tid, self.tokenizer.decode(tid, skip_special_tokens=False))
            if call.pool is None:
                answered.append((s, seq, c, h.respond(*args)))
            else:
                call.pending[id(seq)] = _Pending(seq, c, call.pool.submit(h.respond, *args))
                self.runner.pause(s)
        if call.pending and all(id(sched.slots[s]) in call.pending for s in sched.live(hi)) and not sched.waiting:
            due = list(call.pending.items())  # nothing else to decode meanwhile: answer them all now
        if due:
            # Answers join at a sync fixed by the schedule alone (the one after the call was found), never by
            # how fast a tool ran: the same rollout gives the same tokens, on a GPU's shared sampling stream too.
            slot_of = {id(sched.slots[s]): s for s in sched.live(hi)}
            for key, q in due:
                del call.pending[key]
                answered.append((slot_of[key], q.seq, q.call_end, q.future.result()))  # a handler error: raised
        items = []
        for s, seq, c, out in answered:
            room = min(self._limit(call, seq), self.max_len - seq.length) - c - 1  # keep room for one model token
            if out is None or room < 0:  # the handler ends the sample at its call (or no room is left)
                stop_hits[s] = c
                self.runner.end(s)
                continue
            out = list(out)[:room]
            stop_hits.pop(s, None)  # a stop string past the call was in the discarded tokens
            items.append((s, c, out, seq.length))
            seq.tool_spans.append((c, c + len(out)))
            seq.turns += 1
            seq.turn_start = seq.scanned = c + len(out)
        if items:
            self.runner.continue_with(items, call.params)

    def _scan(self, sched: Scheduler, hi, stops, calls) -> tuple[dict[int, int], dict[int, int]]:
        """(stop hits, tool-call hits): slot -> completion tokens up to and including the token that
        completes one of `stops` (or `calls`) in the slot's current model turn. Only the tokens since
        the last scan are decoded (with SCAN_OVERLAP tokens before them, for strings that straddle
        the boundary), so a long rollout does not re-decode every completion at every sync."""
        live = sched.live(hi)
        _, toks, _, _ = self.runner.tokens_of(live)
        hits: tuple[dict[int, int], dict[int, int]] = ({}, {})
        for s, tid in zip(live, toks):
            seq = sched.slots[s]
            w0 = max(seq.turn_start, seq.scanned - SCAN_OVERLAP)
            seq.scanned = len(tid)
            dec = lambda c: self.tokenizer.decode(tid[w0:c], skip_special_tokens=True)  # noqa: E731
            text = dec(len(tid))
            for strings, out in zip((stops, calls), hits):
                if not any(x in text for x in strings):
                    continue
                for c in range(w0 + 1, len(tid) + 1):  # the shortest prefix that contains one
                    if any(x in dec(c) for x in strings):
                        out[s] = c
                        break
        return hits
