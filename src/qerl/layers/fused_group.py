"""Fused projection groups: q|k|v and gate|up as one matmul on one storage.

The members of a group read the same input, and (NVFP4) share one global scale,
so their packed weights concatenate exactly along the output rows. A `QuantGroup`
owns one tensor per stored quantity ([N_total, ...], members' rows in order) and
one `A_cat` [S*r, K] / `B_cat` [N_total, r] for the adapters; each member's
buffers, bias and LoRA parameters are row views into them. So the trainer keeps
updating per-member parameters (PEFT names and shapes, per-member autograd)
while a rollout reads the group's storage in one call: one shrink for all
adapters and one base matmul whose epilogue adds each member's expand. There is
no copy to keep in sync: an optimizer's in-place step on a member is what the
group reads.

Training runs through the group too (`_GroupTrainMatmul`): one base matmul, one
shrink and the members' expands forward; one base grad-input, one LoRA grad-input
and one grad of A_cat backward, the gradients landing on the members' own
parameters. The model's attention and MLP call their members one by one (q_proj(h),
k_proj(h), ...): the first member's call computes the whole group and the others
pick up their columns (`member_forward`).

Anything that rebinds a member's tensors (`.to()`, `load_quantized` on a layer
outside a group, `add_lora`) breaks the sharing; the group notices (pointer
check) and runs its members one by one until `attach_lora()` rebuilds it.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..formats import NF4
from ..kernels import dispatch, settings
from .qlora_linear import QLoRALinear

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
_REGISTRY = "_qerl_groups"  # parent module attribute: {member attribute names: QuantGroup}


def members_one_by_one():
    """Run the groups' training computation (grad enabled, or `unfused_lora`) member by member, as
    before groups trained fused: for A/B measurements and as the tests' reference. Both passes of a
    PPO step must run under the same setting (their logprobs are compared bit for bit).
    KernelSettings.train_fused off for the block."""
    return settings.use(train_fused=False)


def row_split(fmt, rows: Sequence[int], k: int) -> dict[str, tuple[int, list[int]] | None] | str:
    """For each stored tensor, (the dim that grows with the rows, the members' extents along it) in the
    group's tensor (None: one tensor shared by every member, like NVFP4's global scale), or why the rows do
    not concatenate. The dim is 0 except in layouts that store rows along another (`fmt.split_dims`:
    humming's, formats/nvfp4_humming.py)."""
    if getattr(fmt, "double_quant", False):
        return "NF4 double quantization stores one offset and second-level scales for the whole tensor"
    if isinstance(fmt, NF4) and any(n * k % fmt.block_size for n in rows):
        return f"NF4 blocks of {fmt.block_size} run over the flattened weight and would straddle two members"
    if any(n % fmt.row_tile for n in rows):
        return f"layout {fmt.layout!r} stores rows in tiles of {fmt.row_tile}; member rows {list(rows)}"
    group = fmt.expected_shapes((sum(rows), k))
    one, two = fmt.expected_shapes((rows[0], k)), fmt.expected_shapes((2 * rows[0], k))
    out: dict[str, tuple[int, list[int]] | None] = {}
    for key, (shape, _) in group.items():
        if one[key] == two[key]:  # does not grow with the rows: per tensor
            out[key] = None
            continue
        d = fmt.split_dims.get(key, 0)
        member = [fmt.expected_shapes((n, k))[key][0] for n in rows]
        rest = [tuple(s[:d] + s[d + 1:]) for s in (*member, shape)]
        if len(set(rest)) != 1 or sum(s[d] for s in member) != shape[d]:
            return f"{key} does not split by rows ({[list(s) for s in member]} vs {list(shape)})"
        out[key] = (d, [s[d] for s in member])
    return out


def why_not_fusable(members: Sequence[QLoRALinear]) -> str | None:
    """None when the members can share one storage; otherwise the reason (they stay separate)."""
    if len(members) < 2 or not all(isinstance(m, QLoRALinear) for m in members):
        return "a group needs two or more QLoRALinear members"
    m0 = members[0]
    if any(type(m.fmt) is not type(m0.fmt) or vars(m.fmt) != vars(m0.fmt) for m in members):
        return f"formats differ ({[m.fmt.name for m in members]})"
    if any(m.in_features != m0.in_features or m.dtype != m0.dtype for m in members):
        return "in_features or dtype differ"
    if any(m._device() != m0._device() for m in members):
        return "devices differ"
    if any((m.bias is None) != (m0.bias is None) for m in members):
        return "some members have a bias and some do not"
    if any(m.r != m0.r for m in members):
        return f"LoRA ranks differ ({[m.r for m in members]})"
    if m0.r and any(m.scaling != m0.scaling for m in members):
        return "LoRA scalings differ"
    split = row_split(m0.fmt, [m.out_features for m in members], m0.in_features)
    if isinstance(split, str):
        return split
    for key, ext in split.items():
        ts = [getattr(m, key) for m in members]
        if ext is None and not any(t.is_meta for t in ts):
            if any(not torch.equal(t.view(torch.uint8), ts[0].view(torch.uint8)) for t in ts):
                return f"{key} differs between members (a fused group needs one)"
    return None


class _GroupTrainMatmul(torch.autograd.Function):
    """A group's training matmul, all members at once: y[:, rows of s] = x·Ŵ_sᵀ + b_s +
    scaling·(x·A_sᵀ)·B_sᵀ, then split by the caller.

    Against the members one by one (each its own `_FrozenQuantMatmul`, shrink and expand): one base
    matmul forward and one base grad-input backward over the group's [N_total, K] storage instead
    of S each, so the weight is dequantized once per group per pass, not once per member, and x /
    grad_y are read once; one shrink x·A_catᵀ for every adapter (one read of x); backward's LoRA
    grad-input d_xa·A_cat and gradient of A_cat d_xaᵀ·x one matmul each. Only what involves a
    member's own B stays per member (its expand, its slice of d_xa, its dB). Fewer, larger launches.

    Inputs: x, the group, whether the adapters run, then the members' lora_A weights and their
    lora_B weights: the leaves (row views of A_cat / B_cat), so autograd accumulates each member's
    gradient into its own .grad, as on the member-by-member path. Tensors the backward reads are
    saved with save_for_backward, so gradient checkpointing frees and recomputes them."""

    @staticmethod
    def forward(ctx, x, group, use_lora, *params):
        g = group
        ctx.group, ctx.use_lora = g, use_lora
        y = dispatch.base_matmul(x, g.fmt, g.tensors, g.shape, g.bias)  # one pass over the group's weight
        if not use_lora:
            return y
        xc = x.to(g.A_cat.dtype)  # the adapters' dtype, as the member path casts x for lora_A
        xa = torch.nn.functional.linear(xc, g.A_cat)  # [..., S*r]: one shrink, one read of x, for the group
        ctx.save_for_backward(xc, xa, *params)
        r, scaling = g.members[0].r, g.members[0].scaling
        if y.dtype == xa.dtype == g.B_cat.dtype and y.is_contiguous():
            # each member's expand accumulated into its columns by the GEMM itself (beta = 1): no
            # [M, n] temporaries and no extra elementwise passes over y. (At training sizes no kernel
            # fuses the expand into the base matmul's epilogue: dispatch.LoraTerm would add it after.)
            y2, xa2 = y.view(-1, y.shape[-1]), xa.view(-1, xa.shape[-1])
            for s, (a, b) in enumerate(zip(g.bounds[:-1], g.bounds[1:])):
                y2[:, a:b].addmm_(xa2[:, s * r:(s + 1) * r], g.B_cat[a:b].t(), alpha=scaling)
            return y
        # adapters in another dtype than the activations: the member path's arithmetic (expand, scale, cast)
        return y + dispatch.lora_expand(dispatch.LoraTerm(xa, g.B_cat, scaling, g.seg_starts), y.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        g, need = ctx.group, ctx.needs_input_grad
        S = len(g.members)
        gx = dispatch.base_matmul_grad_input(gy, g.fmt, g.tensors, g.shape) if need[0] else None
        if not ctx.use_lora:
            return (gx, None, None)
        xc, xa, *params = ctx.saved_tensors
        bs = params[S:]
        r, scaling, k = g.members[0].r, g.members[0].scaling, xc.shape[-1]
        xc2, xa2 = xc.reshape(-1, k), xa.reshape(-1, S * r)
        gl = gy.reshape(-1, gy.shape[-1]).to(xa.dtype)  # the LoRA branch's gradient, in the adapters' dtype
        cols = [gl[:, a:b] for a, b in zip(g.bounds[:-1], g.bounds[1:])]
        # per member (its own B): d_xa_s = scaling·gy_s·B_s, dB_s = scaling·gy_sᵀ·xa_s
        d_xa = torch.cat([c @ b for c, b in zip(cols, bs)], dim=1).mul_(scaling)  # [M, S*r]
        d_b = [(c.t() @ xa2[:, s * r:(s + 1) * r]).mul_(scaling) if need[3 + S + s] else None
               for s, c in enumerate(cols)]
        d_a = [None] * S
        if any(need[3:3 + S]):
            da = d_xa.t() @ xc2  # [S*r, K]: every member's dA in one matmul; rows s·r.. are member s's
            d_a = [da[s * r:(s + 1) * r] if need[3 + s] else None for s in range(S)]
        if gx is not None:  # the LoRA path's grad-input, d_xa·A_cat, one matmul added to the base's
            if gx.is_contiguous() and gx.dtype == d_xa.dtype:
                gx.view(-1, k).addmm_(d_xa, g.A_cat)
            else:
                gx = gx + (d_xa @ g.A_cat).to(gx.dtype).view(gx.shape)
        return (gx, None, None, *d_a, *d_b)


class QuantGroup:
    """One storage for a fused group's quantized weights, biases and LoRA factors (see module doc).

    Built from layers that are already in place (their current values are copied in), or from
    layers made with `defer_storage=True` whose meta buffers the group allocates; the loader then
    fills each member's rows with `member.load_quantized(...)`."""

    def __init__(self, members: Sequence[QLoRALinear], names: Sequence[str] | None = None):
        self.members = tuple(members)
        self.names = tuple(names) if names is not None else tuple(f"member {i}" for i in range(len(members)))
        why = why_not_fusable(self.members)
        if why is not None:
            raise ValueError(f"cannot fuse {', '.join(self.names)}: {why}")
        m0 = self.members[0]
        self.fmt, self.in_features = m0.fmt, m0.in_features
        self.rows = tuple(m.out_features for m in self.members)
        self.shape = (sum(self.rows), self.in_features)
        starts = [0]
        for n in self.rows:
            starts.append(starts[-1] + n)
        self.bounds = tuple(starts)
        self.seg_starts = self.bounds[1:-1]  # first rows of members 1..S-1 (dispatch.LoraTerm)
        device = m0._device()
        split = row_split(self.fmt, self.rows, self.in_features)
        self.tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for key, (shape, dt) in self.fmt.expected_shapes(self.shape).items():
                whole = torch.zeros(shape, dtype=dt, device=device)
                views = ([whole] * len(self.members) if split[key] is None
                         else list(whole.split(split[key][1], dim=split[key][0])))
                for m, view in zip(self.members, views):
                    if not getattr(m, key).is_meta:  # an existing layer: take its values along
                        view.copy_(getattr(m, key))
                    m._buffers[key] = view
                self.tensors[key] = whole
            self.bias = None
            if m0.bias is not None:
                self.bias = torch.cat([m.bias.detach() for m in self.members]).to(device)
                for m, v in zip(self.members, self._row_views(self.bias)):
                    m.bias = nn.Parameter(v, requires_grad=m.bias.requires_grad)
        for m in self.members:
            m.group = self
        self.attach_lora()

    def _row_views(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t[a:b] for a, b in zip(self.bounds[:-1], self.bounds[1:])]

    def attach_lora(self) -> None:
        """(Re)build A_cat / B_cat from the members' current adapters and make the members' LoRA
        parameters views into them. Needed after `add_lora` gave a member new parameters (a
        rank change); leaves the group without fused adapters when the members' ranks differ."""
        self.A_cat = self.B_cat = None
        ms = self.members
        if all(m.r for m in ms) and len({(m.r, m.lora_A.weight.dtype, m.lora_A.weight.device) for m in ms}) == 1:
            r = ms[0].r
            with torch.no_grad():
                self.A_cat = torch.cat([m.lora_A.weight.detach() for m in ms])
                self.B_cat = torch.cat([m.lora_B.weight.detach() for m in ms])
            a_views = [self.A_cat[i * r:(i + 1) * r] for i in range(len(ms))]
            for m, a, b in zip(ms, a_views, self._row_views(self.B_cat)):
                m.lora_A.weight = nn.Parameter(a, requires_grad=m.lora_A.weight.requires_grad)
                m.lora_B.weight = nn.Parameter(b, requires_grad=m.lora_B.weight.requires_grad)
        self._ptrs = self._member_ptrs()
        self._warned = False
        self._kept = None  # member_forward: (x, its key, the members' outputs not yet taken)

    def _member_ptrs(self) -> tuple[int, ...]:
        out = []
        for m in self.members:
            out += [m._buffers[k].data_ptr() for k in self.tensors]
            if self.bias is not None:
                out.append(m.bias.data_ptr())
            if self.A_cat is not None and m.r:
                out += [m.lora_A.weight.data_ptr(), m.lora_B.weight.data_ptr()]
        return tuple(out)

    def shares_storage(self) -> bool:
        """Whether every member still views the group's storage (nothing rebound them since)."""
        return self._member_ptrs() == self._ptrs

    @staticmethod
    def _training() -> bool:
        """Whether calls take the training computation (`_GroupTrainMatmul`): autograd on, or under
        `unfused_lora` (a no-grad pass, PPO's old policy, that must give the numbers of the
        grad-enabled pass bit for bit: so it runs the very same computation)."""
        return torch.is_grad_enabled() or not settings.current().fuse_lora

    def _fused_lora(self) -> bool | None:
        """How to run now: True (one call with the adapters), False (one call, base only), or None
        (member by member: training-mode dropout, mixed adapter states, differing scalings, storage no
        longer shared; when training, also a trainable bias or inside `members_one_by_one`). The
        answer does not depend on grad mode, so a grad pass and an unfused_lora pass agree on it."""
        if self._training() and (not settings.current().train_fused or any(m.bias is not None and m.bias.requires_grad
                                                             for m in self.members)):
            return None
        active = [bool(m.r) and not m.disable_adapters for m in self.members]
        if not any(active):
            use = False
        elif not all(active) or self.A_cat is None:
            return None
        elif any(m.scaling != self.members[0].scaling for m in self.members):
            return None
        elif any(m.lora_dropout.training and not isinstance(m.lora_dropout, nn.Identity) for m in self.members):
            return None  # dropout draws a mask per member: keep its semantics
        else:
            use = True
        if not self.shares_storage():
            if not self._warned:
                warnings.warn(f"fused group {', '.join(self.names)} no longer shares storage with its members "
                              "(moved or rebound?); running them one by one", stacklevel=3)
                self._warned = True
            return None
        return use

    def _train(self, x: torch.Tensor, use_lora: bool) -> tuple[torch.Tensor, ...]:
        ms = self.members
        params = [m.lora_A.weight for m in ms] + [m.lora_B.weight for m in ms] if use_lora else []
        return _GroupTrainMatmul.apply(x, self, use_lora, *params).split(self.rows, dim=-1)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The members' outputs (column slices of one matmul where possible)."""
        use_lora = self._fused_lora()
        if use_lora is None:
            return tuple(m(x) for m in self.members)
        if self._training():
            return self._train(x, use_lora)
        lora = None
        if use_lora:
            # One shrink x·A_catᵀ for every member; handing over A_cat (not xa) lets a kernel that can
            # run the shrink inside the matmul's launch do so (dispatch.LoraTerm.shrunk otherwise).
            lora = dispatch.LoraTerm(None, self.B_cat, self.members[0].scaling, self.seg_starts, a=self.A_cat)
        y = dispatch.base_matmul(x, self.fmt, self.tensors, self.shape, self.bias, lora=lora)
        return tuple(y.split(self.rows, dim=-1))

    def _call_key(self, x: torch.Tensor) -> tuple | None:
        """What a kept output depends on besides x's identity (x itself unchanged, the mode, the adapters);
        None for an inference tensor (no version counter to tell an in-place change: nothing is kept)."""
        if x.is_inference():
            return None
        ms = self.members
        lora = () if self.A_cat is None else (self.A_cat._version, self.B_cat._version)
        ks = settings.current()
        return (x._version, torch.is_grad_enabled(), ks.fuse_lora, ks.train_fused, torch.is_autocast_enabled(),
                lora, tuple((m.disable_adapters, m.r and m.scaling, m.lora_dropout.training) for m in ms))

    def member_forward(self, member: QLoRALinear, x: torch.Tensor) -> torch.Tensor | None:
        """member(x) through the group's training computation, or None: the member runs alone (no
        training computation now, or a fallback of `_fused_lora`).

        The model's attention and MLP call their members in turn on one input (q_proj(h), k_proj(h),
        v_proj(h); gate_proj(x), up_proj(x)). The first call runs the whole group and keeps the other
        members' columns; their calls with the same tensor, unchanged and in the same mode, take
        them. Any other call runs the group again (correct, at the cost of the others' columns)."""
        if not self._training():
            return None
        i = self.members.index(member)
        key, kept = self._call_key(x), self._kept
        if key is not None and kept is not None and kept[0]() is x and kept[1] == key and kept[2][i] is not None:
            y, kept[2][i] = kept[2][i], None
            if all(o is None for o in kept[2]):
                self._kept = None
            return y
        self._kept = None
        use_lora = self._fused_lora()
        if use_lora is None:
            return None
        outs = list(self._train(x, use_lora))
        y, outs[i] = outs[i], None
        if key is not None:
            self._kept = (weakref.ref(x), key, outs)
        return y

    forward = __call__

    def __repr__(self) -> str:
        names = ", ".join(self.names)
        return f"QuantGroup({names}; rows={list(self.rows)}, in={self.in_features}, fmt={self.fmt.name})"


# ---- registry: the parent module (self_attn, mlp) knows its groups -------------------------------------


def register(parent: nn.Module, attrs: tuple[str, ...], group: QuantGroup) -> None:
    """Record `group` as parent's fused `attrs` (a plain attribute: not a submodule, so state_dict,
    named_modules and parameters() are unchanged)."""
    if len(attrs) != len(group.members) or any(getattr(parent, a, None) is not m for a, m in zip(attrs, group.members)):
        raise ValueError(f"{type(parent).__name__}: members of {group} are not its {attrs}")
    parent.__dict__.setdefault(_REGISTRY, {})[tuple(attrs)] = group


def group_of(parent: nn.Module, attrs: tuple[str, ...]) -> QuantGroup | None:
    """parent's group over `attrs`, if one exists and its members are still parent's modules."""
    g = parent.__dict__.get(_REGISTRY, {}).get(tuple(attrs))
    if g is None or any(getattr(parent, a, None) is not m for a, m in zip(attrs, g.members)):
        return None
    return g


def fused_groups(model: nn.Module) -> Iterator[tuple[str, QuantGroup]]:
    """(parent module name, group) for every live group in the model."""
    for name, mod in model.named_modules():
        for attrs in list(mod.__dict__.get(_REGISTRY, {})):
            g = group_of(mod, attrs)
            if g is not None:
                yield name, g


def project(parent: nn.Module, attrs: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """getattr(parent, a)(x) for each of attrs: through their group when they have one."""
    g = group_of(parent, attrs)
    return g(x) if g is not None else tuple(getattr(parent, a)(x) for a in attrs)


def fuse(parent: nn.Module, attrs: tuple[str, ...], names: Sequence[str] | None = None) -> QuantGroup | None:
    """Group parent's `attrs` layers in place (copying their values in) when they can be; else None."""
    members = [getattr(parent, a, None) for a in attrs]
    if why_not_fusable(members) is not None:
        return None
    g = QuantGroup(members, names or attrs)
    register(parent, attrs, g)
    return g
