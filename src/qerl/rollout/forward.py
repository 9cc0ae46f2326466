"""The policy's forward pass against the engine's KV cache (Llama / Qwen2 / Qwen3).

It calls the transformers model's own submodules (embeddings, norms, the
QLoRALinear projections, lm_head), so rollouts run on exactly the objects the
trainer updates: no second copy of the weights, no sync step. Only attention
and the cache are ours, because the engine needs a static-shape, slot-indexed
cache that CUDA graphs can replay (transformers' caches are per-batch objects).
Where the loader fused q|k|v or gate|up (layers/fused_group.py), each is one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import dispatch
from ..layers.fused_group import GATE_UP, QKV, project
from . import attention, rope_kv
from .kv_cache import dequantize


# ---- decode glue ---------------------------------------------------------------------------------
# At batch 1 a decode step is ~50 small kernels per layer around the 7 projections (norms, rotary,
# softmax, residuals: ~1500 per step, several microseconds each even in a CUDA graph), which costs
# as much as reading the weights. These functions restate HF's arithmetic (fp32 norm statistics,
# same casts) as a few fusable pieces; `glue_ops(True)` hands them to torch.compile, which fuses
# each into one or two kernels. Eager, they are what the CPU and the tests run.
def rms_norm(x, w, eps: float, noise=None):
    """HF's Llama RMSNorm: w * normalized(x), the statistics in fp32.

    noise: AQN's fp32 Z (rl/aqn.py), or None. With it the weight is w + Z in fp32 and the product is
    rounded once to the output dtype: rounding w + Z to bf16 first would erase any Z below half a
    bf16 ulp of w (all of the schedule's late stages for |w| ~ 1). At Z = 0 the result is bit-identical
    to HF's `w * x_hat`: a product of two bf16 (or fp16) values is exact in fp32, so both round once."""
    xf = x.float()
    xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if noise is None:
        return w * xn
    return ((w.float() + noise) * xn.float()).to(torch.promote_types(w.dtype, x.dtype))


def add_rms_norm(h, d, w, eps: float, noise=None):
    """(h + d, rms_norm(h + d)): the residual add and the next norm in one pass."""
    h = h + d
    return h, rms_norm(h, w, eps, noise)


def rope(q, k, cos, sin):
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def silu_mul(g, u):
    return F.silu(g) * u


def attend_decode(q, k, v, mask, n_kv: int, scaling: float):
    """One query token per slot against its cached keys, grouped by KV head (GQA) so the cache is
    read in place: expanding K/V to every query head would copy the whole cache each layer."""
    s, h, _, d = q.shape
    qg = q.view(s, n_kv, h // n_kv, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scaling  # [S, Hkv, r, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, -1).to(v.dtype)
    return torch.matmul(probs, v).view(s, h, 1, d)


EAGER_GLUE = {f.__name__: f for f in (rms_norm, add_rms_norm, rope, silu_mul, attend_decode)}
_COMPILED: dict = {}


def glue_ops(compiled: bool) -> dict:
    """The decode glue, eager or torch.compile'd (built once per process; each compiles on first call
    per shape family, which the engine's warm-up step does before any CUDA-graph capture)."""
    if not compiled:
        return EAGER_GLUE
    if not _COMPILED:
        # Inductor may skip a cast down and back up (bf16 -> fp32) unless told to emulate it; the norm
        # must round where HF rounds, or zero AQN noise would not reproduce HF's output bit for bit
        import torch._inductor.config as ic

        opts = {"emulate_precision_casts": True} if hasattr(ic, "emulate_precision_casts") else {}
        _COMPILED.update({n: torch.compile(f, dynamic=True, options=opts) for n, f in EAGER_GLUE.items()})
    return _COMPILED


class ModelView:
    """The pieces of a causal LM that the engine calls, and its attention geometry."""

    def __init__(self, model):
        self.model = model
        inner = model.model
        self.embed, self.layers, self.norm, self.lm_head = inner.embed_tokens, inner.layers, inner.norm, model.lm_head
        self.rotary = inner.rotary_emb
        cfg = model.config
        attn = self.layers[0].self_attn
        self.n_layers = len(self.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.vocab = cfg.vocab_size
        self.qk_norm = hasattr(attn, "q_norm")
        self.silu_mlp = getattr(cfg, "hidden_act", None) == "silu"
        self.norm_eps = {id(m): _rms_eps(m) for m in model.modules() if m.__class__.__name__.endswith("RMSNorm")}

    @property
    def device(self):
        return self.embed.weight.device

    @property
    def dtype(self):
        return self.embed.weight.dtype

    def rope_tables(self, max_len: int):
        """cos, sin [max_len, head_dim] from the model's own rotary module (its scaling type included)."""
        pos = torch.arange(max_len, device=self.device)[None]
        x = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = self.rotary(x, pos)
        return cos[0], sin[0]


def _rms_eps(m):
    """eps of a Llama-style RMSNorm (weight * normalized x), or None when the module is another kind."""
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    gemma_like = "Gemma" in m.__class__.__name__  # (1 + w) * x: not ours to restate
    return None if eps is None or gemma_like or getattr(m, "weight", None) is None else float(eps)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _qkv(view: ModelView, attn, h, cos, sin):
    """h [B, T, D] -> q [B, H, T, d], k and v [B, Hkv, T, d], rotary applied (cos/sin [B, 1, T, d])."""
    b, t, _ = h.shape
    q, k, v = (y.view(b, t, -1, view.head_dim) for y in project(attn, QKV, h))
    v = v.transpose(1, 2)
    if view.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q, k, v


def _attend(view, q, k, v, mask):
    gqa = view.n_heads != view.n_kv
    if gqa:  # expand kv heads: portable across SDPA backends (enable_gqa + mask is not everywhere)
        r = view.n_heads // view.n_kv
        k = k.repeat_interleave(r, dim=1)
        v = v.repeat_interleave(r, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=view.scaling)


def prefill(view: ModelView, cache, ids, lengths, slots_per_row, rope, chunk_tokens: int = 2048):
    """Run prompts (right-padded ids [B, T], true lengths [B]) and write their K/V.

    slots_per_row: for each row, the cache slots that receive its K/V (a group's samples share
    one prefill). Returns the fp32 logits at each prompt's last token [B, V].
    Layer by layer, the projections run on all B·T tokens at once (the large-M path), while
    attention and the MLP run over chunks of about chunk_tokens tokens (queries [c0, c1) against
    keys [0, c1)), so neither a [B, H, T, T] score tensor nor a [B·T, intermediate] activation is
    ever held: an 8k-token prompt costs chunk-sized temporaries. Each query row's arithmetic is
    the same as unchunked.
    """
    b, t = ids.shape
    c = max(1, chunk_tokens // b)
    cos, sin = (x[:t][None, None] for x in rope)
    keys = torch.arange(t, device=ids.device)
    mask = (keys[None, :] <= keys[:, None])[None] & (keys[None, None, :] < lengths[:, None, None])
    mask = mask[:, None]  # [B, 1, T, T] bool
    h = view.embed(ids)
    for i, layer in enumerate(view.layers):
        attn = layer.self_attn
        q, k, v = _qkv(view, attn, layer.input_layernorm(h), cos, sin)
        for row, slots in enumerate(slots_per_row):
            if slots:
                cache.write_prefix(i, slots, k[row], v[row], int(lengths[row]))
        o = torch.cat([_attend(view, q[:, :, c0:c0 + c], k[:, :, :c0 + c], v[:, :, :c0 + c],
                               mask[:, :, c0:c0 + c, :c0 + c]) for c0 in range(0, t, c)], 2)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        del q, k, v, o
        h = torch.cat([x + _mlp(view, EAGER_GLUE, layer.mlp, layer.post_attention_layernorm(x))
                       for x in h.split(c, 1)], 1)
    last = h[torch.arange(b, device=ids.device), lengths - 1]
    return _lm_head(view, view.norm(last)).float()


def extend(view: ModelView, cache, slots: list[int], rows: list, starts: list[int], rope):
    """Append tokens to slots whose caches hold positions [0, start): row r's ids [T_r] go to slot
    slots[r] at [starts[r], starts[r] + T_r), each attending to that slot's cached keys and to the new
    ones before it. Returns the fp32 logits at each row's last new token [B, V]. The multi-turn path:
    tools' outputs join their sequences without re-prefilling what came before, every pending sample's
    in one forward (rows right-padded; a padded query sees its row's keys and is never read)."""
    dev = rows[0].device
    b = len(rows)
    lens = torch.tensor([r.shape[0] for r in rows], device=dev)
    t = int(lens.max())
    st = torch.tensor(starts, device=dev)
    ids = torch.zeros(b, t, dtype=torch.long, device=dev)
    for r, x in enumerate(rows):
        ids[r, : x.shape[0]] = x
    pos = (st[:, None] + torch.arange(t, device=dev)[None]).clamp(max=rope[0].shape[0] - 1)  # [B, T]
    cos, sin = (x[pos][:, None] for x in rope)  # [B, 1, T, d]
    ends = st + lens
    n_keys = int(ends.max())
    keys = torch.arange(n_keys, device=dev)
    mask = (keys[None, None, :] <= pos[:, :, None]) & (keys[None, None, :] < ends[:, None, None])
    mask = mask[:, None]  # [B, 1, T, keys]
    h = view.embed(ids)
    for i, layer in enumerate(view.layers):
        attn = layer.self_attn
        q, k, v = _qkv(view, attn, layer.input_layernorm(h), cos, sin)
        kc, vc = [], []
        for r, slot in enumerate(slots):
            n = rows[r].shape[0]
            cache.write_span(i, slot, k[r, :, :n], v[r, :, :n], starts[r])
            kr, vr = cache.read_span(i, slot, n_keys, q.dtype)  # past a row's end: masked
            kc.append(kr)
            vc.append(vr)
        o = _attend(view, q, torch.stack(kc), torch.stack(vc), mask)
        h = h + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        h = h + _mlp(view, EAGER_GLUE, layer.mlp, layer.post_attention_layernorm(h))
    last = h[torch.arange(b, device=dev), lens - 1]
    return _lm_head(view, view.norm(last)).float()


def _norm(view, ops, norm, x):
    eps = view.norm_eps.get(id(norm))
    return norm(x) if eps is None else ops["rms_norm"](x, norm.weight, eps, _noise(norm))


def _add_norm(view, ops, norm, h, d):
    eps = view.norm_eps.get(id(norm))
    if eps is None:
        h = h + d
        return h, norm(h)
    return ops["add_rms_norm"](h, d, norm.weight, eps, _noise(norm))


def _noise(norm):
    """The norm's AQN noise buffer (zeros outside a noisy block), or None for a norm AQN does not noise.
    AQN fills it in place, so a CUDA graph captured after AQN was built reads each step's noise."""
    return getattr(norm, "aqn_noise", None)


def _mlp(view, ops, mlp, x):
    if not view.silu_mlp:
        return mlp(x)
    return mlp.down_proj(ops["silu_mul"](*project(mlp, GATE_UP, x)))


def fused_attention_ok(view: ModelView) -> bool:
    """Whether decode can use the fused rotary+KV-write and split-KV attention kernels (CUDA,
    power-of-two head size; Qwen3's q/k norms sit between projection and rotary, so not there)."""
    probe = view.embed.weight
    return not view.qk_norm and rope_kv.supports(probe, view.head_dim)


def _lm_head(view, h):
    """The logits: on the CPU, inside the rollout's cache, through the packed weight (dispatch.frozen_linear)."""
    return dispatch.frozen_linear(view.lm_head, h)


def decode(view: ModelView, cache, tokens, pos, n_slots: int, n_keys: int, rope, ops=EAGER_GLUE,
           fused: bool = False):
    """One token for slots 0..n_slots-1: tokens [S], positions [S] -> fp32 logits [S, V].

    Static shapes for a given (n_slots, n_keys), no host syncs: the step CUDA graphs replay.
    Same arithmetic as HF's layers, in fewer pieces (see the decode glue above). fused: rotary and
    the cache write in one kernel, then split-KV attention (rollout/attention.py); a layer is then
    norm, q|k|v, rope+write, attention (2), o, add+norm, gate|up, SiLU·mul, down, add+norm.
    """
    s, d = tokens.shape[0], view.head_dim
    h = view.embed(tokens[:, None])
    x = _norm(view, ops, view.layers[0].input_layernorm, h)
    if fused:
        lengths = pos + 1
    else:
        cos, sin = (t[pos][:, None, None] for t in rope)  # [S, 1, 1, d]
        mask = (torch.arange(n_keys, device=pos.device)[None, :] <= pos[:, None])[:, None, None]  # [S, 1, 1, L]
    for i, layer in enumerate(view.layers):
        attn = layer.self_attn
        kc, vc, ks, vs = cache.layer(i)
        if fused:
            q, k, v = (y[:, 0] for y in project(attn, QKV, x))
            q = rope_kv.rope_kv_write(q, k, v, rope[0], rope[1], pos, kc, vc, ks, vs)
            o = attention.decode_attention(q, kc, vc, lengths, n_keys, view.scaling, ks, vs).view(s, 1, -1)
        else:
            q, k, v = (y.view(s, 1, -1, d) for y in project(attn, QKV, x))
            v = v.transpose(1, 2)
            if view.qk_norm:
                q, k = _norm(view, ops, attn.q_norm, q), _norm(view, ops, attn.k_norm, k)
            q, k = ops["rope"](q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            cache.write_token(i, n_slots, pos, k[:, :, 0], v[:, :, 0])
            kk, vv = kc[:n_slots, :, :n_keys], vc[:n_slots, :, :n_keys]
            if cache.fp8:
                kk, vv = dequantize(kk, ks[:n_slots], q.dtype), dequantize(vv, vs[:n_slots], q.dtype)
            o = ops["attend_decode"](q, kk, vv, mask, view.n_kv, view.scaling).transpose(1, 2).reshape(s, 1, -1)
        h, x = _add_norm(view, ops, layer.post_attention_layernorm, h, attn.o_proj(o))
        nxt = view.layers[i + 1].input_layernorm if i + 1 < view.n_layers else view.norm
        h, x = _add_norm(view, ops, nxt, h, _mlp(view, ops, layer.mlp, x))
    return _lm_head(view, x[:, 0]).float()
