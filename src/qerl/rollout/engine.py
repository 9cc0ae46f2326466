"""The rollout engine: continuous batching over a static slot cache, on the live policy.

    engine = Engine(policy.model, policy.tokenizer, max_len=2048)
    outs = engine.generate(prompts, n=8, params=SamplingParams(max_new_tokens=512, temperature=1.0))

Each prompt is prefilled once; its n samples get the prompt's K/V copied into
their slots (a sample admitted later copies it from a sibling still in flight,
or the prompt is prefilled again). Decode steps run every slot in [0, B) for a
bucketed B; on CUDA each (B, key-length bucket) step is a captured CUDA graph.
The host looks at the state only every `sync_every` steps: it retires finished
slots, admits waiting samples into free ones and compacts the tail into holes,
so short and long completions don't hold each other back.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..device_memory import free_bytes
from ..kernels import dispatch
from .forward import ModelView, decode, fused_attention_ok, glue_ops, prefill
from .kv_cache import KVCache, slots_for_budget
from .sampling import SamplingParams, sample

REASONS = {1: "eos", 2: "length", 3: "stop"}
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # of each sampled token, under the distribution it was sampled from
    finish_reason: str  # eos | stop | length
    text: str | None = None


@dataclass
class RolloutStats:
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: int = 0
    graphs_captured: int = 0
    max_batch: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


@dataclass
class _Slot:
    prompt: int
    sample: int
    length: int  # prompt length


class Engine:
    def __init__(self, model, tokenizer=None, *, max_len: int = 2048, max_slots: int = 256,
                 kv_cache_gb: float | None = None, cuda_graphs: bool | None = None, sync_every: int = 16,
                 prefill_tokens: int = 8192, cache_dequantized: bool | None = None, compile: bool | None = None,
                 kv_cache_dtype: str = "auto", fused_attention: bool | None = None):
        self.view = ModelView(model)
        self.model, self.tokenizer = model, tokenizer
        dev = self.view.device
        self.max_len, self.sync_every, self.prefill_tokens = max_len, sync_every, prefill_tokens
        if kv_cache_gb is None:  # half of what is free now on a GPU (under a memory cap); 1 GiB on the CPU
            kv_cache_gb = free_bytes(dev) * 0.5 / 2**30 if dev.type == "cuda" else 1.0
        self.n_slots = slots_for_budget(self.view, max_len, int(kv_cache_gb * 2**30), max_slots, kv_cache_dtype)
        self.cache = KVCache(self.view, self.n_slots, max_len, kv_cache_dtype)
        self.fused_attention = fused_attention_ok(self.view) if fused_attention is None else fused_attention
        self.rope = self.view.rope_tables(max_len)
        self.cuda_graphs = dev.type == "cuda" if cuda_graphs is None else cuda_graphs
        # fuse the decode step's small ops (norms, rotary, softmax) on GPUs; see forward.compile_glue
        self.ops = glue_ops(dev.type == "cuda" if compile is None else compile)
        # without kernels (CPU), keep dequantized weights for the rollout's duration
        self.cache_dequantized = dev.type != "cuda" if cache_dequantized is None else cache_dequantized
        S = self.n_slots
        z = lambda dt: torch.zeros(S, dtype=dt, device=dev)  # noqa: E731
        self.tokens, self.pos, self.count = z(torch.long), z(torch.long), z(torch.long)
        self.skey = z(torch.long)  # each slot's sample key (keyed CPU sampling)
        self.active, self.done, self.reason = z(torch.bool), z(torch.bool), z(torch.int8)
        self.out_tok = torch.zeros(S, max_len, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(S, max_len, dtype=torch.float32, device=dev)
        self.max_new_t = torch.zeros((), dtype=torch.long, device=dev)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._graph_key = None
        self._pool = None
        self.stats = RolloutStats()

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
                 progress: bool = False, prompt_keys: list[int] | None = None) -> list[Completion]:
        """prompts: strings (tokenized as they are: apply a chat template first) or token-id lists.

        Returns len(prompts)·n completions, ordered by prompt then sample. perturb: a context
        manager entered around the whole rollout (AQN's noise on the norm weights). On the CPU with
        a seed, sample j of prompt i draws from keyed_uniform(seed, prompt_keys[i]·n + j, position)
        (prompt_keys default to 0..len-1), so its tokens depend on neither batch nor slot.
        """
        p = params or SamplingParams()
        ids = [self._encode(x) for x in prompts]
        for i, x in enumerate(ids):
            if not x:
                raise ValueError(f"prompt {i} is empty")
            if len(x) >= self.max_len:
                raise ValueError(f"prompt {i} has {len(x)} tokens; the engine's max_len is {self.max_len}")
        self._setup(p)
        self._keys = list(prompt_keys) if prompt_keys is not None else list(range(len(ids)))
        if len(self._keys) != len(ids):
            raise ValueError(f"{len(self._keys)} prompt_keys for {len(ids)} prompts")
        self._n = n
        t0 = time.perf_counter()
        self.stats = RolloutStats()
        waiting = [(i, j) for i in range(len(ids)) for j in range(n)]
        waiting.reverse()  # pop() from the end = in order
        slots: list[_Slot | None] = [None] * self.n_slots
        prompt_logits: dict[int, torch.Tensor] = {}
        left = {i: n for i in range(len(ids))}
        results: dict[tuple, Completion] = {}
        bar = tqdm(total=len(waiting), desc="rollout", unit="seq", disable=not progress)
        cache = dispatch.dequantized_cache() if self.cache_dequantized else contextlib.nullcontext()
        with cache, perturb if perturb is not None else contextlib.nullcontext():
            while waiting or any(s is not None for s in slots):
                self._admit(waiting, slots, ids, prompt_logits, left, p)
                hi = max(i for i, s in enumerate(slots) if s is not None) + 1
                b = next((x for x in BUCKETS if x >= hi), self.n_slots)
                b = min(b, self.n_slots)
                self.stats.max_batch = max(self.stats.max_batch, hi)
                max_pos = int(max(s.length for s in slots[:hi] if s is not None)) + int(self.count[:hi].max())
                keys = min(self.max_len, -(-(max_pos + self.sync_every + 1) // 128) * 128)
                for _ in range(self.sync_every):
                    self._run_step(b, keys, p)
                self.stats.steps += self.sync_every
                bar.update(self._retire(slots, results, ids, p, hi))
                if not waiting:
                    self._compact(slots)
        bar.close()
        if self.view.device.type == "cuda":
            torch.cuda.synchronize()
        self.stats.seconds = time.perf_counter() - t0
        self.stats.new_tokens = sum(len(c.token_ids) for c in results.values())
        return [results[(i, j)] for i in range(len(ids)) for j in range(n)]

    @torch.no_grad()
    def warmup(self, batch_sizes, params: SamplingParams | None = None, max_len: int | None = None) -> int:
        """Capture the decode graphs a rollout of these batch sizes will use (all key-length buckets),
        so that no capture lands inside a timed or latency-critical rollout. Returns graphs captured."""
        if not self.cuda_graphs:
            return 0
        p = params or SamplingParams()
        self._setup(p)
        before = len(self._graphs)
        top = min(max_len or self.max_len, self.max_len)
        for n in batch_sizes:
            b = min(next((x for x in BUCKETS if x >= n), self.n_slots), self.n_slots)
            for keys in range(128, top + 128, 128):
                self._run_step(b, min(keys, self.max_len), p)  # no slot is active: state is untouched
        torch.cuda.synchronize()
        return len(self._graphs) - before

    # ---- internals ---------------------------------------------------------------------------
    def _encode(self, x) -> list[int]:
        if isinstance(x, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass token ids instead")
            return self.tokenizer(x, add_special_tokens=False)["input_ids"]
        return [int(t) for t in x]

    def _setup(self, p: SamplingParams):
        key = (p.greedy, p.temperature, p.top_p, p.top_k, p.ignore_eos, tuple(p.stop_token_ids or ()))
        if key != self._graph_key:
            # graphs bake the sampling settings in: keep each setting's graphs (training and evaluation
            # alternate); past a few settings drop them all and start a fresh memory pool (capturing
            # into the pool of destroyed graphs trips the CUDA caching allocator)
            if len({k[0] for k in self._graphs} | {key}) > 4:
                self._graphs.clear()
                self._pool = None
            self._graph_key = key
        if p.max_new_tokens > self.max_len:
            raise ValueError(f"max_new_tokens {p.max_new_tokens} exceeds the engine's max_len {self.max_len}")
        dev = self.view.device
        self.max_new_t.fill_(p.max_new_tokens)
        eos = [] if p.ignore_eos else self.eos_ids()
        stop = [] if p.ignore_eos else list(p.stop_token_ids or [])
        self.eos_t = torch.tensor(eos or [-1], dtype=torch.long, device=dev)
        self.stop_t = torch.tensor(stop or [-1], dtype=torch.long, device=dev)
        self.gen = None
        if p.seed is not None:
            if dev.type == "cuda":  # graphs replay the default CUDA generator's stream
                torch.cuda.manual_seed(p.seed)
            else:
                self.gen = torch.Generator(device=dev).manual_seed(p.seed)
        self.active.zero_(), self.done.zero_(), self.count.zero_()

    def _keyed(self, p: SamplingParams, keys, pos):
        """Keyed sampling on the CPU with a seed; CUDA keeps the generator stream its graphs replay."""
        if p.seed is None or self.view.device.type == "cuda":
            return None
        return (p.seed, keys, pos)

    def _finish_flags(self, tok, count, pos):
        """(finished, reason code) for sequences that just appended `tok` (count tokens, next write at pos)."""
        eos = torch.isin(tok, self.eos_t)
        stop = torch.isin(tok, self.stop_t)
        full = (count >= self.max_new_t) | (pos >= self.max_len - 1)
        code = torch.where(eos, 1, torch.where(stop, 3, 2)).to(torch.int8)
        return eos | stop | full, code

    def _step(self, b: int, keys: int, p: SamplingParams):
        logits = decode(self.view, self.cache, self.tokens[:b], self.pos[:b], b, keys, self.rope, self.ops,
                        self.fused_attention)
        tok, lp = sample(logits, p, self.gen, self._keyed(p, self.skey[:b], self.count[:b]))
        act = self.active[:b] & ~self.done[:b]
        idx = self.count[:b].clamp(max=self.max_len - 1)[:, None]
        self.out_tok[:b].scatter_(1, idx, torch.where(act, tok, self.out_tok[:b].gather(1, idx)[:, 0])[:, None])
        self.out_lp[:b].scatter_(1, idx, torch.where(act, lp, self.out_lp[:b].gather(1, idx)[:, 0])[:, None])
        a = act.long()
        self.count[:b] += a
        self.pos[:b] += a
        self.tokens[:b] = torch.where(act, tok, self.tokens[:b])
        fin, code = self._finish_flags(tok, self.count[:b], self.pos[:b])
        newly = act & fin
        self.reason[:b] = torch.where(newly, code, self.reason[:b])
        self.done[:b] |= newly

    def _run_step(self, b, keys, p):
        if not self.cuda_graphs:
            return self._step(b, keys, p)
        g = self._graphs.get((self._graph_key, b, keys))
        if g is None:
            state = [t.clone() for t in (self.tokens, self.pos, self.count, self.done, self.reason, self.out_tok,
                                         self.out_lp)]
            rng = torch.cuda.get_rng_state()  # the warm-up's samples must not shift the seeded stream
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up: compiles kernels, sizes workspaces (its K/V writes are the real ones)
                self._step(b, keys, p)
            torch.cuda.current_stream().wait_stream(s)
            for t, v in zip((self.tokens, self.pos, self.count, self.done, self.reason, self.out_tok, self.out_lp),
                            state):
                t.copy_(v)
            torch.cuda.set_rng_state(rng)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                self._step(b, keys, p)
            self._graphs[(self._graph_key, b, keys)] = g
            self.stats.graphs_captured += 1
        g.replay()

    def _admit(self, waiting, slots, ids, prompt_logits, left, p):
        free = [i for i, s in enumerate(slots) if s is None]
        if not free or not waiting:
            return
        t0 = time.perf_counter()
        admitted = []
        while free and waiting:
            i, j = waiting.pop()
            s = free.pop(0)
            slots[s] = _Slot(i, j, len(ids[i]))
            admitted.append(s)
        # K/V: copy from a sibling in flight whose prefix is in the cache, else prefill (batched)
        need: dict[int, list[int]] = {}
        for s in admitted:
            pi = slots[s].prompt
            src = next((k for k, o in enumerate(slots) if o is not None and o.prompt == pi and k not in admitted
                        and pi in prompt_logits), None)
            if src is not None:
                self.cache.copy_slot(src, s, slots[s].length)
            else:
                need.setdefault(pi, []).append(s)
        self._prefill(need, ids, prompt_logits)
        # first token from the prompt's last logits
        dev = self.view.device
        rows = torch.tensor(admitted, device=dev)
        logits = torch.stack([prompt_logits[slots[s].prompt] for s in admitted])
        self.skey[rows] = torch.tensor([self._keys[slots[s].prompt] * self._n + slots[s].sample for s in admitted],
                                       device=dev)
        tok, lp = sample(logits, p, self.gen, self._keyed(p, self.skey[rows], torch.zeros_like(rows)))
        self.tokens[rows] = tok
        self.pos[rows] = torch.tensor([slots[s].length for s in admitted], device=dev)
        self.count[rows] = 1
        self.out_tok[rows, 0] = tok
        self.out_lp[rows, 0] = lp
        self.active[rows] = True
        fin, code = self._finish_flags(tok, self.count[rows], self.pos[rows])
        self.reason[rows] = code
        self.done[rows] = fin
        for s in admitted:
            left[slots[s].prompt] -= 1
        for pi in [k for k, v in left.items() if v == 0 and k in prompt_logits]:
            del prompt_logits[pi]  # every sample of it is in flight: no one needs its logits again
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _prefill(self, need: dict[int, list[int]], ids, prompt_logits):
        order = sorted(need, key=lambda i: -len(ids[i]))
        dev = self.view.device
        while order:
            batch, t = [], 0
            while order and (not batch or (len(batch) + 1) * max(t, len(ids[order[0]])) <= self.prefill_tokens):
                i = order.pop(0)
                batch.append(i)
                t = max(t, len(ids[i]))
            x = torch.zeros(len(batch), t, dtype=torch.long, device=dev)
            for r, i in enumerate(batch):
                x[r, : len(ids[i])] = torch.tensor(ids[i], device=dev)
            lengths = torch.tensor([len(ids[i]) for i in batch], device=dev)
            logits = prefill(self.view, self.cache, x, lengths, [need[i] for i in batch], self.rope)
            for r, i in enumerate(batch):
                prompt_logits[i] = logits[r]

    def _retire(self, slots, results, ids, p, hi) -> int:
        done = self.done[:hi].cpu()
        stop_hits = {}
        if p.stop and self.tokenizer is not None:
            stop_hits = self._stop_strings(slots, hi, p)
        fin = [s for s in range(hi) if slots[s] is not None and (bool(done[s]) or s in stop_hits)]
        if not fin:
            return 0
        counts = self.count[fin].cpu().tolist()
        reasons = self.reason[fin].cpu().tolist()
        toks = self.out_tok[fin].cpu()
        lps = self.out_lp[fin].cpu()
        for r, s in enumerate(fin):
            c = counts[r]
            reason = REASONS.get(reasons[r], "length") if bool(done[s]) else "stop"
            if s in stop_hits and (not bool(done[s]) or stop_hits[s] < c):
                c, reason = stop_hits[s], "stop"
            sl = slots[s]
            tid = toks[r, :c].tolist()
            results[(sl.prompt, sl.sample)] = Completion(
                sl.prompt, sl.sample, ids[sl.prompt], tid, lps[r, :c].tolist(), reason,
                self.tokenizer.decode(tid, skip_special_tokens=True) if self.tokenizer is not None else None)
            slots[s] = None
        rows = torch.tensor(fin, device=self.view.device)
        self.active[rows] = False
        return len(fin)

    def _stop_strings(self, slots, hi, p) -> dict[int, int]:
        """slot -> number of tokens up to and including the one that completes a stop string."""
        live = [s for s in range(hi) if slots[s] is not None]
        counts = self.count[live].cpu().tolist()
        toks = self.out_tok[live].cpu()
        hits = {}
        for r, s in enumerate(live):
            tid = toks[r, : counts[r]].tolist()
            text = self.tokenizer.decode(tid, skip_special_tokens=True)
            if not any(x in text for x in p.stop):
                continue
            for c in range(1, len(tid) + 1):  # the shortest prefix that contains a stop string
                if any(x in self.tokenizer.decode(tid[:c], skip_special_tokens=True) for x in p.stop):
                    hits[s] = c
                    break
        return hits

    def _compact(self, slots):
        """Move the highest live slots into the lowest holes, so the decode batch bucket can shrink."""
        while True:
            holes = [i for i, s in enumerate(slots) if s is None]
            live = [i for i, s in enumerate(slots) if s is not None]
            if not holes or not live or holes[0] > live[-1]:
                return
            src, dst = live[-1], holes[0]
            n = int(self.pos[src]) + 1
            self.cache.copy_slot(src, dst, min(n, self.max_len))
            for t in (self.tokens, self.pos, self.count, self.active, self.done, self.reason, self.out_tok, self.out_lp,
                      self.skey):
                t[dst] = t[src]
            self.active[src] = False
            slots[dst], slots[src] = slots[src], None
