"""The policy's forward pass against the engine's KV cache, for every family of model/families/.

It calls the transformers model's own submodules (embeddings, norms, the
QLoRALinear projections, lm_head), so rollouts run on exactly the objects the
trainer updates: no second copy of the weights, no sync step. Only attention
and the cache are ours, because the engine needs a static-shape, slot-indexed
cache that CUDA graphs can replay (transformers' caches are per-batch objects).
Where the loader fused q|k|v or gate|up (layers/fused_group.py), each is one call.

What differs between families is read from the family's description (model/family.py): which
norms a layer has and where, q/k norms, fused qkv/gate_up checkpoints, each layer's sliding
window (keys (p - w, p] seen by position p, as transformers' sliding_window_overlay) and rotary
table (Gemma 3's local/global layers), partial rotary. A model no family describes is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import dispatch
from ..layers.fused_group import project
from ..layers.quant_embed import table_device_dtype
from ..model.family import UnsupportedModelError, family_of_model, llama_norm_classes
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


def noisy_norm(x, w, eps: float, noise, form: str):
    """A non-Llama RMSNorm (Family.norm_form) with AQN's fp32 Z added to its effective weight, restated
    from transformers' arithmetic so that at Z = 0 it is its module's output bit for bit:
      offset  Gemma 3: (x_hat * (1 + w)).to(dtype), the effective weight 1 + w gets + Z
      fp32    Olmo 2, gpt-oss: (w * x_hat).to(dtype), x_hat in fp32 (never rounded before the product)"""
    xf = x.float()
    xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if form == "offset":
        return (xn * ((1.0 + w.float()) + noise)).to(x.dtype)
    if form == "fp32":
        return ((w.float() + noise) * xn).to(x.dtype)
    raise ValueError(f"noisy_norm: unknown norm form {form!r}")


def input_noise(x, noise):
    """AQN where no norm precedes a projection group (Olmo 2's post-norm layers): the group's input
    times (1 + Z) per input channel, in fp32 and rounded once: the (1 + Z/w) of a norm whose weight is
    1. Z = 0 gives x back bit for bit. noise None: x unchanged."""
    return x if noise is None else (x.float() * (1.0 + noise)).to(x.dtype)


def add_rms_norm(h, d, w, eps: float, noise=None):
    """(h + d, rms_norm(h + d)): the residual add and the next norm in one pass."""
    h = h + d
    return h, rms_norm(h, w, eps, noise)


def rope(q, k, cos, sin):
    return _rotary(q, cos, sin), _rotary(k, cos, sin)


def _rotary(x, cos, sin):
    """HF's rotate-half rotary on the first cos.shape[-1] dims (all of them, or Phi's partial rotary)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    xr = x[..., :r]
    return torch.cat((xr * cos + _rotate_half(xr) * sin, x[..., r:]), dim=-1)


def silu_mul(g, u):
    return F.silu(g) * u


def attend_decode(q, k, v, mask, n_kv: int, scaling: float, sinks=None):
    """One query token per slot against its cached keys, grouped by KV head (GQA) so the cache is
    read in place: expanding K/V to every query head would copy the whole cache each layer.
    sinks [H]: gpt-oss's per-head logit that joins the softmax and is dropped after it."""
    s, h, _, d = q.shape
    qg = q.view(s, n_kv, h // n_kv, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scaling  # [S, Hkv, r, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, -1).to(v.dtype)
    else:
        probs = _softmax_with_sinks(scores, sinks.float().view(1, n_kv, h // n_kv, 1)).to(v.dtype)
    return torch.matmul(probs, v).view(s, h, 1, d)


def _softmax_with_sinks(scores, sinks):
    """transformers' gpt-oss attention: the sink logit joins each row, the max is subtracted, the
    softmax runs, and the sink's column is dropped (so the probabilities sum to less than 1)."""
    x = torch.cat([scores, sinks.expand(*scores.shape[:-1], 1).to(scores.dtype)], -1)
    x = x - x.max(-1, keepdim=True).values
    return torch.softmax(x, -1)[..., :-1]


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
    """The pieces of a causal LM that the engine calls, its attention geometry and its family's layer.

    Refuses (UnsupportedModelError) a model whose class, layers or config no family describes."""

    def __init__(self, model):
        self.family = fam = family_of_model(model)
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
        self.qk_norm = fam.qk_norm  # None, "head" or "width"
        self.sinks = fam.sinks
        self.qkv = tuple(fam.attr(t) for t in fam.qkv)  # attention's input projection(s): 3, or 1 fused
        self.gate_up = tuple(fam.attr(t) for t in fam.gate_up)
        self.split = (self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim)
        self.norms = fam.norms
        self.act = fam.act
        self.silu_mlp = getattr(cfg, "hidden_act", None) == "silu"
        self.windows = fam.windows(cfg)  # each layer's sliding window, or None
        self.rope_keys = fam.layer_types(cfg)  # each layer's rotary table
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.norm_eps = ({id(m): _rms_eps(m) for m in model.modules() if m.__class__.__name__.endswith("RMSNorm")}
                         if fam.llama_norm else {})
        rot = self.rope_tables(1).cos.shape[-1]
        # the decode step's fused rotary+cache-write and split-KV attention kernels run this layer only
        self.plain_attention = (self.qk_norm is None and not self.sinks and all(w is None for w in self.windows)
                                and set(self.rope_keys) == {None} and rot == self.head_dim)

    @property
    def device(self):
        return table_device_dtype(self.embed)[0]

    @property
    def dtype(self):
        return table_device_dtype(self.embed)[1]

    def rope_tables(self, max_len: int) -> "RopeTables":
        """cos, sin [max_len, rotary dims] per rotary table, from the model's own rotary module (its
        scaling type, partial rotary and per-layer-type tables included)."""
        _check_rope_type(self.rotary, self.model.config, max_len)
        pos = torch.arange(max_len, device=self.device)[None]
        x = torch.zeros(1, device=self.device, dtype=self.dtype)
        tables = {}
        for key in dict.fromkeys(self.rope_keys):
            cos, sin = self.rotary(x, pos) if key is None else self.rotary(x, pos, key)
            if self.family.rope_halves:  # gpt-oss: x1·c − x2·s, x2·c + x1·s is rotate-half on doubled tables
                cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
            tables[key] = (cos[0], sin[0])
        return RopeTables(tables, self.rope_keys)


class RopeTables:
    """The rotary tables of an engine: one per layer type, and which one each layer reads."""

    def __init__(self, tables: dict, keys: list):
        self.tables, self.keys = tables, keys
        self.cos, self.sin = tables[keys[0]]  # layer 0's (the only one for most families)

    def layer(self, i: int):
        return self.tables[self.keys[i]]

    def __len__(self) -> int:
        return self.cos.shape[0]


def _check_rope_type(rotary, config, max_len: int) -> None:
    """Rotary types whose tables transformers switches by the sequence's length cannot be one static
    table: longrope (short factors up to original_max_position_embeddings, long past it) and dynamic
    NTK. Within that length HF uses the short table for every call, and so does the engine."""
    kind = getattr(rotary, "rope_type", None)
    kinds = set(kind.values()) if isinstance(kind, dict) else {kind}
    if not kinds & {"longrope", "dynamic"}:
        return
    rp = getattr(config, "rope_parameters", None) or {}
    orig = (rp.get("original_max_position_embeddings") if isinstance(rp, dict) else None) or \
        getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings
    if max_len > orig:
        raise UnsupportedModelError(f"{type(rotary).__name__}: {'/'.join(sorted(map(str, kinds)))} rotary changes its "
                                    f"tables past {orig} positions (original_max_position_embeddings); an engine of "
                                    f"max_len {max_len} cannot follow it: use max_len <= {orig}")


LLAMA_NORMS = llama_norm_classes()  # the family spec's (Family.llama_norm): one source


def norm_eps(m) -> float | None:
    """An RMSNorm module's eps (transformers calls it variance_epsilon or eps), or None."""
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    return None if eps is None else float(eps)


def _rms_eps(m):
    """eps of a Llama-style RMSNorm (weight * normalized x, rounded to x's dtype first), or None when
    the module is another kind (Gemma's (1 + w), Olmo's (w * x_hat).to(dtype): its own module runs it,
    or `noisy_norm` under AQN)."""
    llama_like = m.__class__.__name__ in LLAMA_NORMS
    return None if not llama_like or getattr(m, "weight", None) is None else norm_eps(m)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _project_qkv(view: ModelView, attn, h):
    """q, k, v as the projections give them ([..., H·d], [..., Hkv·d] twice): one call each, one group
    call, or one fused qkv_proj split by heads (Phi-3). The projections are called here, not through
    attention's forward, so AQN's input noise (a family with no norm before q/k/v) is applied here."""
    ys = project(attn, view.qkv, input_noise(h, _noise(attn)))
    return ys[0].split(view.split, dim=-1) if len(ys) == 1 else ys


def _qkv(view: ModelView, attn, h, cos, sin):
    """h [B, T, D] -> q [B, H, T, d], k and v [B, Hkv, T, d], rotary applied (cos/sin [B, 1, T, r])."""
    b, t, _ = h.shape
    q, k, v = _project_qkv(view, attn, h)
    if view.qk_norm == "width":  # Olmo: one norm over all heads, before the reshape
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = (y.reshape(b, t, -1, view.head_dim) for y in (q, k, v))
    v = v.transpose(1, 2)
    if view.qk_norm == "head":
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    return _rotary(q, cos, sin), _rotary(k, cos, sin), v


def _windowed(mask, qpos, kpos, window):
    """mask & (key position > query position - window): transformers' sliding_window_overlay."""
    return mask if window is None else mask & (kpos > qpos - window)


def _sub_norm(layer, name):
    return getattr(layer, name) if name is not None else None


def _apply(norm, x):
    return x if norm is None else norm(x)


def _attend(view, q, k, v, mask, attn=None):
    gqa = view.n_heads != view.n_kv
    if gqa:  # expand kv heads: portable across SDPA backends (enable_gqa + mask is not everywhere)
        r = view.n_heads // view.n_kv
        k = k.repeat_interleave(r, dim=1)
        v = v.repeat_interleave(r, dim=1)
    if view.sinks:  # SDPA has no sink logit: transformers' eager gpt-oss attention, restated
        scores = (torch.matmul(q, k.transpose(-1, -2)) * view.scaling).masked_fill(~mask, float("-inf"))
        probs = _softmax_with_sinks(scores, attn.sinks.view(1, -1, 1, 1))
        return torch.matmul(probs.to(v.dtype), v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=view.scaling)


def prefill(view: ModelView, cache, ids, lengths, slots_per_row, rope, chunk_tokens: int = 2048):
    """Run prompts (right-padded ids [B, T], true lengths [B]) and write their K/V.

    slots_per_row: for each row, the cache slots that receive its K/V (a group's samples share
    one prefill). Returns the fp32 logits at each prompt's last token [B, V].
    Layer by layer, the projections run on all B·T tokens at once (the large-M path), while
    attention and the MLP run over chunks of about chunk_tokens tokens (queries [c0, c1) against
    keys [0, c1)), so neither a [B, H, T, T] score tensor nor a [B·T, intermediate] activation is
    ever held: an 8k-token prompt costs chunk-sized temporaries. Each query row's arithmetic is
    the same as unchunked. A sliding-window layer masks keys at or before position - window.
    """
    b, t = ids.shape
    c = max(1, chunk_tokens // b)
    keys = torch.arange(t, device=ids.device)
    mask = (keys[None, :] <= keys[:, None])[None] & (keys[None, None, :] < lengths[:, None, None])
    mask = mask[:, None]  # [B, 1, T, T] bool
    masks = {w: _windowed(mask, keys[:, None], keys[None, :], w) for w in set(view.windows)}
    nm = view.norms
    h = view.embed(ids)
    for i, layer in enumerate(view.layers):
        attn = layer.self_attn
        cos, sin = (x[:t][None, None] for x in rope.layer(i))
        q, k, v = _qkv(view, attn, _apply(_sub_norm(layer, nm.attn_in), h), cos, sin)
        for row, slots in enumerate(slots_per_row):
            if slots:
                cache.write_prefix(i, slots, k[row], v[row], int(lengths[row]))
        m = masks[view.windows[i]]
        o = torch.cat([_attend(view, q[:, :, c0:c0 + c], k[:, :, :c0 + c], v[:, :, :c0 + c],
                               m[:, :, c0:c0 + c, :c0 + c], attn) for c0 in range(0, t, c)], 2)
        h = h + _apply(_sub_norm(layer, nm.attn_out), attn.o_proj(o.transpose(1, 2).reshape(b, t, -1)))
        del q, k, v, o
        h = torch.cat([x + _mlp_block(view, EAGER_GLUE, layer, x) for x in h.split(c, 1)], 1)
    last = h[torch.arange(b, device=ids.device), lengths - 1]
    return _lm_head(view, view.norm(last)).float()


def _mlp_block(view, ops, layer, x):
    """What the MLP adds to the residual stream: its input norm, the MLP, its output norm (each where
    the family has one)."""
    nm = view.norms
    return _apply(_sub_norm(layer, nm.mlp_out), _mlp(view, ops, layer.mlp, _apply(_sub_norm(layer, nm.mlp_in), x)))


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
    pos = (st[:, None] + torch.arange(t, device=dev)[None]).clamp(max=len(rope) - 1)  # [B, T]
    ends = st + lens
    n_keys = int(ends.max())
    keys = torch.arange(n_keys, device=dev)
    mask = (keys[None, None, :] <= pos[:, :, None]) & (keys[None, None, :] < ends[:, None, None])
    masks = {w: _windowed(mask, pos[:, :, None], keys[None, None, :], w)[:, None] for w in set(view.windows)}
    nm = view.norms
    h = view.embed(ids)
    for i, layer in enumerate(view.layers):
        attn = layer.self_attn
        cos, sin = (x[pos][:, None] for x in rope.layer(i))  # [B, 1, T, r]
        q, k, v = _qkv(view, attn, _apply(_sub_norm(layer, nm.attn_in), h), cos, sin)
        kc, vc = [], []
        for r, slot in enumerate(slots):
            n = rows[r].shape[0]
            cache.write_span(i, slot, k[r, :, :n], v[r, :, :n], starts[r])
            kr, vr = cache.read_span(i, slot, n_keys, q.dtype)  # past a row's end: masked
            kc.append(kr)
            vc.append(vr)
        o = _attend(view, q, torch.stack(kc), torch.stack(vc), masks[view.windows[i]], attn)
        h = h + _apply(_sub_norm(layer, nm.attn_out), attn.o_proj(o.transpose(1, 2).reshape(b, t, -1)))
        h = h + _mlp_block(view, EAGER_GLUE, layer, h)
    last = h[torch.arange(b, device=dev), lens - 1]
    return _lm_head(view, view.norm(last)).float()


def _norm(view, ops, norm, x):
    eps, z = view.norm_eps.get(id(norm)), _noise(norm)
    if eps is not None:
        return ops["rms_norm"](x, norm.weight, eps, z)
    if z is None:
        return norm(x)
    # a non-Llama norm AQN noises: its restatement reads the buffer, so a CUDA graph captured outside
    # a noisy block still carries each step's noise (the module's own forward would not)
    return noisy_norm(x, norm.weight, norm_eps(norm), z, view.family.norm_form)


def _add_norm(view, ops, norm, h, d):
    """(h + d, norm(h + d)); norm None: (h + d, h + d) (a layer with no norm there)."""
    if norm is None:
        h = h + d
        return h, h
    eps = view.norm_eps.get(id(norm))
    if eps is None:
        h = h + d
        return h, _norm(view, ops, norm, h)
    return ops["add_rms_norm"](h, d, norm.weight, eps, _noise(norm))


def _noise(module):
    """The AQN noise buffer of a norm (or, where no norm precedes the projections, of the attention or
    MLP block): zeros outside a noisy block, None where AQN does not noise. AQN fills it in place, so a
    CUDA graph captured after AQN was built reads each step's noise."""
    return getattr(module, "aqn_noise", None)


def _mlp(view, ops, mlp, x):
    """down(act(gate) · up), gate|up from two projections, their group, or one fused gate_up_proj; an MoE
    block runs as transformers' own (its router, then the 4-bit experts' loop over the hit experts)."""
    if view.family.experts is not None:
        y = mlp(x)
        return y[0] if isinstance(y, tuple) else y  # gpt-oss's block also returns its router scores
    ys = project(mlp, view.gate_up, input_noise(x, _noise(mlp)))
    g, u = ys[0].chunk(2, dim=-1) if len(ys) == 1 else ys
    if view.silu_mlp:
        return mlp.down_proj(ops["silu_mul"](g, u))
    return mlp.down_proj(getattr(mlp, view.act)(g) * u)


def fused_attention_ok(view: ModelView) -> bool:
    """Whether decode can use the fused rotary+KV-write and split-KV attention kernels (CUDA,
    power-of-two head size; Qwen3's q/k norms sit between projection and rotary, so not there)."""
    probe = torch.empty(0, device=view.device)
    return view.plain_attention and rope_kv.supports(probe, view.head_dim)


def _lm_head(view, h):
    """The logits: on the CPU, inside the rollout's cache, through the packed weight (dispatch.frozen_linear);
    capped as transformers caps them where the config says so (Gemma's final_logit_softcapping)."""
    logits = dispatch.frozen_linear(view.lm_head, h)
    if view.softcap is not None:
        logits = torch.tanh(logits / view.softcap) * view.softcap
    return logits


def decode(view: ModelView, cache, tokens, pos, n_slots: int, n_keys: int, rope, ops=EAGER_GLUE,
           fused: bool = False):
    """One token for slots 0..n_slots-1: tokens [S], positions [S] -> fp32 logits [S, V].

    Static shapes for a given (n_slots, n_keys), no host syncs: the step CUDA graphs replay.
    Same arithmetic as HF's layers, in fewer pieces (see the decode glue above). fused: rotary and
    the cache write in one kernel, then split-KV attention (rollout/attention.py); a layer is then
    norm, q|k|v, rope+write, attention (2), o, add+norm, gate|up, SiLU·mul, down, add+norm.
    """
    if fused and not view.plain_attention:
        raise UnsupportedModelError(f"{view.family.name}: the fused decode attention runs no q/k norms, sliding "
                                    "windows, per-layer rotary tables or partial rotary; use fused_attention=False")
    s, d = tokens.shape[0], view.head_dim
    nm = view.norms
    h = view.embed(tokens[:, None])
    x = h if nm.attn_in is None else _norm(view, ops, getattr(view.layers[0], nm.attn_in), h)
    if fused:
        lengths = pos + 1
    else:
        keys = torch.arange(n_keys, device=pos.device)[None, :]
        mask = keys <= pos[:, None]
        masks = {w: _windowed(mask, pos[:, None], keys, w)[:, None, None] for w in set(view.windows)}  # [S, 1, 1, L]
    for i, layer in enumerate(view.layers):
        attn = layer.self_attn
        kc, vc, ks, vs = cache.layer(i)
        if fused:
            q, k, v = (y[:, 0] for y in _project_qkv(view, attn, x))
            q = rope_kv.rope_kv_write(q, k, v, rope.cos, rope.sin, pos, kc, vc, ks, vs)
            o = attention.decode_attention(q, kc, vc, lengths, n_keys, view.scaling, ks, vs).view(s, 1, -1)
        else:
            cos, sin = (t[pos][:, None, None] for t in rope.layer(i))  # [S, 1, 1, r]
            q, k, v = _project_qkv(view, attn, x)
            if view.qk_norm == "width":
                q, k = _norm(view, ops, attn.q_norm, q), _norm(view, ops, attn.k_norm, k)
            q, k, v = (y.reshape(s, 1, -1, d) for y in (q, k, v))
            v = v.transpose(1, 2)
            if view.qk_norm == "head":
                q, k = _norm(view, ops, attn.q_norm, q), _norm(view, ops, attn.k_norm, k)
            q, k = ops["rope"](q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            cache.write_token(i, n_slots, pos, k[:, :, 0], v[:, :, 0])
            kk, vv = kc[:n_slots, :, :n_keys], vc[:n_slots, :, :n_keys]
            if cache.fp8:
                kk, vv = dequantize(kk, ks[:n_slots], q.dtype), dequantize(vv, vs[:n_slots], q.dtype)
            o = ops["attend_decode"](q, kk, vv, masks[view.windows[i]], view.n_kv, view.scaling,
                                     attn.sinks if view.sinks else None)
            o = o.transpose(1, 2).reshape(s, 1, -1)
        o = attn.o_proj(o)
        if nm.attn_out is not None:
            o = _norm(view, ops, getattr(layer, nm.attn_out), o)
        h, x = _add_norm(view, ops, _sub_norm(layer, nm.mlp_in), h, o)
        m = _mlp(view, ops, layer.mlp, x)
        if nm.mlp_out is not None:
            m = _norm(view, ops, getattr(layer, nm.mlp_out), m)
        nxt = _sub_norm(view.layers[i + 1], nm.attn_in) if i + 1 < view.n_layers else view.norm
        h, x = _add_norm(view, ops, nxt, h, m)
    return _lm_head(view, x[:, 0]).float()
