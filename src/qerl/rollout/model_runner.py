"""The rollout's tensors: the KV cache, the per-slot state, prefill, the decode step and its graphs.

Everything the scheduler decides in Python happens here on the device: a prompt's prefill into
its slots, the first token of each admitted sample, decode steps over the slots [0, B) (one
CUDA graph per (sampling setting, B, key-length bucket)), reading finished slots back, moving
a slot. The per-slot state is one dataclass, so snapshots, moves and resets cover every field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .forward import decode, extend, fused_attention_ok, glue_ops, prefill
from .kv_cache import KVCache
from .sampling import SamplingParams, sample


@dataclass
class SlotState:
    """What a slot's sequence carries between decode steps; one row per slot."""
    tokens: torch.Tensor  # [S] long: the token the next step feeds
    pos: torch.Tensor  # [S] long: where that token's K/V goes
    count: torch.Tensor  # [S] long: tokens generated
    limit: torch.Tensor  # [S] long: the sample's own limit of new tokens (<= max_new_tokens), set at admission
    skey: torch.Tensor  # [S] long: the sample's key (keyed CPU sampling)
    active: torch.Tensor  # [S] bool: holds a sequence
    done: torch.Tensor  # [S] bool: finished (EOS, stop token, length, own limit)
    reason: torch.Tensor  # [S] int8: 1 eos, 2 length, 3 stop, 4 limit (the sample's own, below max_new_tokens)
    out_tok: torch.Tensor  # [S, L] long: generated tokens
    out_lp: torch.Tensor  # [S, L] fp32: their logprobs under the sampling distribution

    @classmethod
    def zeros(cls, n: int, max_len: int, device) -> "SlotState":
        z = lambda dt, *shape: torch.zeros(n, *shape, dtype=dt, device=device)  # noqa: E731
        return cls(tokens=z(torch.long), pos=z(torch.long), count=z(torch.long), limit=z(torch.long),
                   skey=z(torch.long), active=z(torch.bool), done=z(torch.bool), reason=z(torch.int8),
                   out_tok=z(torch.long, max_len), out_lp=z(torch.float32, max_len))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in dataclasses.fields(self)]

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.tensors()]

    def restore(self, snap: list[torch.Tensor]) -> None:
        for t, v in zip(self.tensors(), snap):
            t.copy_(v)

    def move(self, src: int, dst: int) -> None:
        for t in self.tensors():
            t[dst] = t[src]
        self.active[src] = False


# "limit": a benchmark's per-sample limit (SamplingParams.sample_max_new_tokens) ended the sample. It
# emulates a completion that ends by itself, so it is not "length": the trainer counts only "length" as
# truncated (truncated_fraction, mask_truncated_completions), and a varied-length benchmark must not look
# all-truncated. Its own name, not "eos", because no EOS token was sampled (the last token is an ordinary one)
REASONS = {1: "eos", 2: "length", 3: "stop", 4: "limit"}
MAX_STOP_IDS = 16  # EOS ids, and stop token ids, a rollout may name


class ModelRunner:
    def __init__(self, view, n_slots: int, max_len: int, *, kv_cache_dtype: str = "auto", cuda_graphs: bool,
                 compile: bool, fused_attention: bool | None = None, graph_max_batch: int | None = None):
        """graph_max_batch: decode batches above it run eager even with cuda_graphs (an MoE's decode is
        capturable only where the grouped GEMV takes it: moe_gemv.MAX_TOKENS tokens)."""
        self.view, self.n_slots, self.max_len = view, n_slots, max_len
        self.graph_max_batch = graph_max_batch
        dev = view.device
        self.cache = KVCache(view, n_slots, max_len, kv_cache_dtype)
        self.rope = view.rope_tables(max_len)
        self.cuda_graphs = cuda_graphs
        self.ops = glue_ops(compile)  # the decode step's small ops, fused by torch.compile on GPUs
        self.fused_attention = fused_attention_ok(view) if fused_attention is None else fused_attention
        self.state = SlotState.zeros(n_slots, max_len, dev)
        # the rollout's max_new_tokens, refilled in place (graphs read it by address); each slot's own
        # limit (<= this) is the per-slot state.limit, written when the slot is admitted
        self.max_new_t = torch.zeros((), dtype=torch.long, device=dev)
        # EOS and stop ids live in fixed buffers refilled in place: a captured graph reads these
        # addresses on every replay, so a tensor re-created per rollout would leave it reading freed
        # memory (and finishing sequences at random tokens)
        self.eos_t = torch.full((MAX_STOP_IDS,), -1, dtype=torch.long, device=dev)
        self.stop_t = torch.full((MAX_STOP_IDS,), -1, dtype=torch.long, device=dev)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.graphs_captured = 0
        self._graph_key = None
        self._pool = None
        self._capture_stream = None
        self.gen = None

    # ---- settings ----------------------------------------------------------------------------
    def setup(self, p: SamplingParams, eos: list[int]) -> None:
        key = (p.greedy, p.temperature, p.top_p, p.top_k, p.ignore_eos, tuple(p.stop_token_ids or ()))
        if key != self._graph_key:
            # graphs bake the sampling settings in: keep each setting's graphs (training and evaluation
            # alternate); past a few settings drop them all and start a fresh memory pool (capturing
            # into the pool of destroyed graphs trips the CUDA caching allocator)
            if len({k[0] for k in self.graphs} | {key}) > 4:
                self.graphs.clear()
                self._pool = None
            self._graph_key = key
        dev = self.view.device
        self.max_new_t.fill_(p.max_new_tokens)
        stop = [] if p.ignore_eos else list(p.stop_token_ids or [])
        eos = [] if p.ignore_eos else list(eos)
        for name, ids in (("EOS", eos), ("stop", stop)):
            if len(ids) > MAX_STOP_IDS:
                raise ValueError(f"{len(ids)} {name} token ids; the engine takes at most {MAX_STOP_IDS}")
        for buf, ids in ((self.eos_t, eos), (self.stop_t, stop)):
            buf.fill_(-1)  # -1 is never a token
            if ids:
                buf[:len(ids)] = torch.tensor(ids, dtype=torch.long)
        self.gen = None
        if p.seed is not None:
            if dev.type == "cuda":  # graphs replay the default CUDA generator's stream
                torch.cuda.manual_seed(p.seed)
            else:
                self.gen = torch.Generator(device=dev).manual_seed(p.seed)
        st = self.state
        st.active.zero_(), st.done.zero_(), st.count.zero_()

    def _keyed(self, p: SamplingParams, keys, pos):
        """Keyed sampling on the CPU with a seed; CUDA keeps the generator stream its graphs replay."""
        if p.seed is None or self.view.device.type == "cuda":
            return None
        return (p.seed, keys, pos)

    def _finish_flags(self, tok, count, pos, limit):
        """(finished, reason code) for sequences that just appended `tok` (count tokens, next write at pos,
        each its own limit of new tokens)."""
        # a plain comparison, not torch.isin: isin picks a sorting path (not capturable) for longer id lists
        eos = (tok[:, None] == self.eos_t).any(-1)
        stop = (tok[:, None] == self.stop_t).any(-1)
        full = (count >= self.max_new_t) | (pos >= self.max_len - 1)
        own = count >= limit  # limit <= max_new_tokens: below it, the sample's own limit ended it
        code = torch.where(eos, 1, torch.where(stop, 3, torch.where(full, 2, 4))).to(torch.int8)
        return eos | stop | full | own, code

    # ---- prompts -----------------------------------------------------------------------------
    def prefill(self, need: dict[int, list[int]], ids: list[list[int]], max_tokens: int,
                chunk_tokens: int = 2048) -> dict[int, torch.Tensor]:
        """Prefill each prompt of `need` into its slots, batched up to max_tokens (padded) per batch,
        attention and MLP in chunks of chunk_tokens; returns each prompt's last-token logits."""
        order = sorted(need, key=lambda i: -len(ids[i]))
        dev = self.view.device
        logits_of = {}
        while order:
            batch, t = [], 0
            while order and (not batch or (len(batch) + 1) * max(t, len(ids[order[0]])) <= max_tokens):
                i = order.pop(0)
                batch.append(i)
                t = max(t, len(ids[i]))
            x = torch.zeros(len(batch), t, dtype=torch.long, device=dev)
            for r, i in enumerate(batch):
                x[r, : len(ids[i])] = torch.tensor(ids[i], device=dev)
            lengths = torch.tensor([len(ids[i]) for i in batch], device=dev)
            logits = prefill(self.view, self.cache, x, lengths, [need[i] for i in batch], self.rope, chunk_tokens)
            for r, i in enumerate(batch):
                logits_of[i] = logits[r]
        return logits_of

    def copy_prompt(self, src: int, dst: int, length: int) -> None:
        self.cache.copy_slot(src, dst, length)

    def start(self, slots: list[int], logits: torch.Tensor, skeys: list[int], lengths: list[int],
              p: SamplingParams, limits: list[int] | None = None) -> None:
        """Sample each admitted slot's first token from its prompt's logits [n, V] and arm the slot.
        limits: each slot's own limit of new tokens (<= p.max_new_tokens; default max_new_tokens)."""
        dev, st = self.view.device, self.state
        rows = torch.tensor(slots, device=dev)
        st.skey[rows] = torch.tensor(skeys, device=dev)
        st.limit[rows] = torch.tensor(limits if limits is not None else [p.max_new_tokens] * len(slots), device=dev)
        tok, lp = sample(logits, p, self.gen, self._keyed(p, st.skey[rows], torch.zeros_like(rows)))
        st.tokens[rows] = tok
        st.pos[rows] = torch.tensor(lengths, device=dev)
        st.count[rows] = 1
        st.out_tok[rows, 0] = tok
        st.out_lp[rows, 0] = lp
        st.active[rows] = True
        fin, code = self._finish_flags(tok, st.count[rows], st.pos[rows], st.limit[rows])
        st.reason[rows] = code
        st.done[rows] = fin

    # ---- decode ------------------------------------------------------------------------------
    def _step(self, b: int, keys: int, p: SamplingParams):
        st = self.state
        logits = decode(self.view, self.cache, st.tokens[:b], st.pos[:b], b, keys, self.rope, self.ops,
                        self.fused_attention)
        tok, lp = sample(logits, p, self.gen, self._keyed(p, st.skey[:b], st.count[:b]))
        act = st.active[:b] & ~st.done[:b]
        idx = st.count[:b].clamp(max=self.max_len - 1)[:, None]
        st.out_tok[:b].scatter_(1, idx, torch.where(act, tok, st.out_tok[:b].gather(1, idx)[:, 0])[:, None])
        st.out_lp[:b].scatter_(1, idx, torch.where(act, lp, st.out_lp[:b].gather(1, idx)[:, 0])[:, None])
        a = act.long()
        st.count[:b] += a
        st.pos[:b] += a
        st.tokens[:b] = torch.where(act, tok, st.tokens[:b])
        fin, code = self._finish_flags(tok, st.count[:b], st.pos[:b], st.limit[:b])
        newly = act & fin
        st.reason[:b] = torch.where(newly, code, st.reason[:b])
        st.done[:b] |= newly

    def graphed(self, b: int) -> bool:
        """Whether a decode step of batch b replays a CUDA graph."""
        return self.cuda_graphs and (self.graph_max_batch is None or b <= self.graph_max_batch)

    def step(self, b: int, keys: int, p: SamplingParams) -> None:
        """One decode step over slots [0, b) with keys [0, keys): replayed from a graph on CUDA."""
        if not self.graphed(b):
            return self._step(b, keys, p)
        g = self.graphs.get((self._graph_key, b, keys))
        if g is None:
            snap = self.state.snapshot()
            rng = torch.cuda.get_rng_state()  # the warm-up's samples must not shift the seeded stream
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm-up: compiles kernels, sizes workspaces (its K/V writes are the real ones)
                self._step(b, keys, p)
            torch.cuda.current_stream().wait_stream(s)
            self.state.restore(snap)
            torch.cuda.set_rng_state(rng)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
                # This runner's own capture stream: the kernels' split-K counters are owned per stream
                # (kernels/counters.py), and torch's default capture stream is shared by every graph, so two
                # engines replaying at once (a rollout beside another engine's) would count each other's CTAs.
                self._capture_stream = self._capture_stream or torch.cuda.Stream()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool, stream=self._capture_stream):
                self._step(b, keys, p)
            self.graphs[(self._graph_key, b, keys)] = g
            self.graphs_captured += 1
        g.replay()

    def continue_with(self, items: list[tuple[int, int, list[int], int]], p: SamplingParams) -> None:
        """Multi-turn: for each (slot, keep, tokens, length), cut the slot's completion back to its first
        `keep` tokens, append `tokens` (a tool's output: in the sequence, not sampled, logprob 0), and
        sample the next model token after them. Only the new tokens run through the model (every item's
        in one forward); the cached prefixes are reused."""
        st, dev = self.state, self.view.device
        slots = [it[0] for it in items]
        starts = [length + keep - 1 for _, keep, _, length in items]  # the last kept token: sampled, not yet fed
        rows = [torch.tensor([int(st.out_tok[slot, keep - 1])] + list(toks), device=dev)
                for slot, keep, toks, _ in items]
        logits = extend(self.view, self.cache, slots, rows, starts, self.rope)
        for (slot, keep, toks, _), ids in zip(items, rows):
            if toks:
                st.out_tok[slot, keep:keep + len(toks)] = ids[1:]
                st.out_lp[slot, keep:keep + len(toks)] = 0.0
        r = torch.tensor(slots, device=dev)
        at = torch.tensor([keep + len(toks) for _, keep, toks, _ in items], device=dev)  # the new token's index
        tok, lp = sample(logits, p, self.gen, self._keyed(p, st.skey[r], at))
        st.out_tok[r, at] = tok
        st.out_lp[r, at] = lp
        st.count[r] = at + 1
        st.pos[r] = torch.tensor(starts, device=dev) + at - torch.tensor([k for _, k, _, _ in items], device=dev) + 1
        st.tokens[r] = tok
        fin, code = self._finish_flags(tok, st.count[r], st.pos[r], st.limit[r])
        st.done[r], st.reason[r] = fin, code

    def end(self, slot: int) -> None:
        """Finish a slot as stopped (the engine cuts it at its stop: the turn handler ended it)."""
        self.state.done[slot] = True
        self.state.reason[slot] = 3

    def pause(self, slot: int) -> None:
        """Hold a slot out of decoding (its tool call is running): flagged done, so steps leave its tokens,
        count and position alone, until `continue_with` resumes it (or the engine retires it)."""
        self.state.done[slot] = True

    # ---- reading back ------------------------------------------------------------------------
    def finished(self, hi: int) -> list[bool]:
        return self.state.done[:hi].cpu().tolist()

    def max_count(self, hi: int) -> int:
        return int(self.state.count[:hi].max())

    def tokens_of(self, slots: list[int]) -> tuple[list[int], list[list[int]], list[list[float]], list[str]]:
        """(counts, token ids, logprobs, finish reasons) of the given slots, one transfer each."""
        st = self.state
        counts = st.count[slots].cpu().tolist()
        reasons = st.reason[slots].cpu().tolist()
        toks = st.out_tok[slots].cpu()
        lps = st.out_lp[slots].cpu()
        return (counts, [toks[r, :c].tolist() for r, c in enumerate(counts)],
                [lps[r, :c].tolist() for r, c in enumerate(counts)], [REASONS.get(x, "length") for x in reasons])

    def release(self, slots: list[int]) -> None:
        self.state.active[torch.tensor(slots, device=self.view.device)] = False

    def move(self, src: int, dst: int) -> None:
        """A live slot into a hole: its K/V up to its position and its state."""
        n = int(self.state.pos[src]) + 1
        self.cache.copy_slot(src, dst, min(n, self.max_len))
        self.state.move(src, dst)
