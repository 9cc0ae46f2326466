"""QuantExperts: an MoE's experts in 4 bits, in transformers 5's fused 3-D layout.

transformers 5 keeps a layer's experts as two parameters, `gate_up_proj` and `down_proj` (Qwen3-MoE,
Mixtral: [E, N, K], applied as x·Wᵀ; gpt-oss: transposed, [E, K, N] applied as x·W, with biases and
gate/up interleaved), called with the router's choice as
`experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`. Here each of the two is held as
its format's tensors stacked over the experts, always [E, N, K] so blocks run along the inputs (NVFP4:
packed codes [E, N, K/2], FP8 block scales [E, N, K/16], one global scale per expert, gate|up sharing
it as one fused projection; MXFP4: codes and E8M0 scales [E, N, K/32], gpt-oss's own bytes). The call
runs transformers' own loop over the active experts, each expert's weights dequantized when it is hit:
on the CPU, a loop over the active experts, never a dequantized copy of every expert (which does not
fit a large MoE). The gating between the two projections is the HF module's own `_apply_gate`
(silu(g)·u on halves, or gpt-oss's clamped (u + 1)·g·σ(1.702 g) on interleaved columns). Routers stay
in the model's dtype and are not touched.

LoRA on the experts (`add_lora`) has PEFT's per-expert factors, A [E, r, K] and B [E, N, r] for each
of the two projections (checkpoint/expert_lora.py writes and reads PEFT's target_parameters files),
and runs on each expert's own tokens as shrink and expand, (x·A_eᵀ)·B_eᵀ·scaling: W + BA is never
formed in the forward (export merges it).

Which of three paths a call runs is kernels/experts_path.py's choice (the engine reads the same
function): the loop above (the CPU); on CUDA, by default,
  grouped (KernelSettings.moe_grouped; `grouped` on a module overrides it): prefill and the update.
    Tokens sorted by expert (as vLLM's moe_align_block_size, without the padding torch._grouped_mm does
    not need), the hit experts dequantized a chunk at a time (at most `expert_chunk` of them: a whole
    layer of gpt-oss-120b's experts is 6 GB in bf16) and one grouped matmul per projection, LoRA's shrink
    and expand grouped the same way. It equals the loop (tests/test_moe_grouped.py); H100, one
    Qwen3-30B-A3B expert layer at 2048 tokens: 4.7 ms against the loop's 94.8.
  gemv (KernelSettings.moe_gemv): decode, a no-grad call of at most MOE_GEMV_MAX_TOKENS tokens
    (kernels/m_thresholds.py). Each projection is one grouped 4-bit GEMV over the hit experts
    (kernels/moe_gemv.py: only their bytes read, each once, decoded in registers, no host sync, so CUDA
    graphs hold it), with LoRA, biases, gating and the combine around it. It equals the loop
    (tests/test_moe_gemv.py, and against a float64 reference on the GPU); H100, the same layer: 0.86 /
    0.69 / 0.98 ms at 1 / 8 / 64 tokens against the loop's 6.2 / 34.4 / 102.4.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ..formats import get_format
from ..kernels.experts_path import GEMV, GROUPED, experts_path, fast_dequant

PROJECTIONS = ("gate_up_proj", "down_proj")


class QuantExperts(nn.Module):
    def __init__(self, tensors: dict[str, dict[str, torch.Tensor]], shapes: dict[str, tuple[int, int]], fmt,
                 glu: Callable, dtype: torch.dtype, name: str = "experts", biases: dict | None = None,
                 transposed: bool = False):
        """tensors[proj]: the format's tensors stacked over experts; shapes[proj]: one expert's [N, K].
        glu: gate_up output [T, N] -> the down projection's input; biases[proj]: [E, N] or absent;
        transposed: HF holds these experts as [E, K, N] (x·W), as its checkpoint and export do."""
        super().__init__()
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        self.glu, self.dtype, self.name, self.transposed = glu, dtype, name, transposed
        self.shapes = {p: tuple(shapes[p]) for p in PROJECTIONS}
        self.num_experts = next(iter(tensors["gate_up_proj"].values())).shape[0]
        for proj in PROJECTIONS:
            for key, t in tensors[proj].items():
                if t.shape[0] != self.num_experts:
                    raise ValueError(f"{name}.{proj}: {t.shape[0]} experts, gate_up_proj has {self.num_experts}")
                self.register_buffer(f"{proj}_{key}", t)
        self.has_bias = bool(biases)
        for proj, b in (biases or {}).items():
            self.register_buffer(f"{proj}_bias", b.to(dtype))
        self.r, self.lora_alpha, self.scaling = 0, 0.0, 0.0
        self.lora_A = self.lora_B = None
        self.disable_adapters = False  # layers.adapters_disabled: the base policy (KL reference, parity gate)
        self.grouped: bool | None = None  # None: KernelSettings.moe_grouped decides; tests force one path
        self.expert_chunk = 16
        self.routing_log: list | None = None  # layers/routing.py: record_routing appends each call's choices

    def add_lora(self, r: int, lora_alpha: float, dtype: torch.dtype | None = None) -> None:
        """Trainable per-expert factors for both projections: A as PEFT initialises its flat
        nn.Linear(K, r·E) (uniform ±1/√K), B zeros, so the adapter starts as the identity."""
        dev = next(iter(self._buffers.values())).device
        dtype = dtype or self.dtype
        a, b = {}, {}
        for proj in PROJECTIONS:
            n, k = self.shapes[proj]
            bound = 1 / math.sqrt(k)
            a[proj] = nn.Parameter(torch.empty(self.num_experts, r, k, dtype=dtype, device=dev).uniform_(-bound, bound))
            b[proj] = nn.Parameter(torch.zeros(self.num_experts, n, r, dtype=dtype, device=dev))
        self.lora_A, self.lora_B = nn.ParameterDict(a), nn.ParameterDict(b)
        self.r, self.lora_alpha, self.scaling = r, float(lora_alpha), float(lora_alpha) / r

    def lora_delta(self, proj: str, e: int) -> torch.Tensor | None:
        """scaling·B_e·A_e [N, K] of expert e (export merges it; the forward never forms it)."""
        if not self.r:
            return None
        return (self.lora_B[proj][e].float() @ self.lora_A[proj][e].float()) * self.scaling

    def merged_weight(self, proj: str, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = self.weight(proj, e, torch.float32)
        d = self.lora_delta(proj, e)
        return (w if d is None else w + d).to(dtype)

    @classmethod
    def quantize(cls, gate_up: torch.Tensor, down: torch.Tensor, fmt, glu, dtype, name="experts", biases=None,
                 transposed=False) -> "QuantExperts":
        """From dense experts [E, N, K] (gate_up, down), quantized one expert at a time."""
        fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        tensors = {}
        for proj, w in zip(PROJECTIONS, (gate_up, down)):
            per = []
            for e in range(w.shape[0]):
                fmt.validate(w[e], f"{name}.{proj}[{e}]")
                gs = fmt.global_scale([w[e]]) if fmt.has_global_scale else None
                per.append(fmt.quantize(w[e], gs))
            tensors[proj] = {k: torch.stack([t[k] for t in per]) for k in per[0]}
        shapes = {"gate_up_proj": tuple(gate_up.shape[1:]), "down_proj": tuple(down.shape[1:])}
        return cls(tensors, shapes, fmt, glu, dtype, name, biases, transposed)

    @classmethod
    def from_hf(cls, experts: nn.Module, fmt, name: str = "experts") -> "QuantExperts":
        """From a transformers experts module (its 3-D gate_up_proj / down_proj, biases and gating)."""
        missing = [p for p in PROJECTIONS if not isinstance(getattr(experts, p, None), torch.Tensor)]
        if missing:
            raise ValueError(f"{name} ({type(experts).__name__}): no 3-D {', '.join(missing)} parameter; QuantExperts "
                             "reads transformers 5's fused expert layout")
        transposed = bool(getattr(experts, "is_transposed", False))
        ws = [getattr(experts, p).detach() for p in PROJECTIONS]
        if transposed:
            ws = [w.transpose(1, 2) for w in ws]
        biases = ({p: getattr(experts, f"{p}_bias").detach() for p in PROJECTIONS}
                  if getattr(experts, "has_bias", False) else None)
        return cls.quantize(*ws, fmt, experts._apply_gate, experts.gate_up_proj.dtype, name, biases, transposed)

    def tensors(self, proj: str, e: int) -> dict[str, torch.Tensor]:
        pre = proj + "_"
        return {k[len(pre):]: b[e] for k, b in self._buffers.items() if k.startswith(pre) and k != f"{proj}_bias"}

    def stacked(self, proj: str) -> dict[str, torch.Tensor]:
        """proj's format tensors over all experts, [E, ...] each."""
        pre = proj + "_"
        return {k[len(pre):]: b for k, b in self._buffers.items() if k.startswith(pre) and k != f"{proj}_bias"}

    def bias(self, proj: str) -> torch.Tensor | None:
        return self._buffers.get(f"{proj}_bias")

    def weight(self, proj: str, e: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert e's dequantized [N, K] weight of `proj`."""
        return self.fmt.dequantize(self.tensors(proj, e), self.shapes[proj], dtype or self.dtype)

    def weights(self, proj: str, experts: list[int], dtype: torch.dtype) -> torch.Tensor:
        """[len(experts), N, K]: those experts' dequantized weights of `proj`, in one launch on the GPU
        (kernels/moe_dequant.py, bit-equal to the format's dequantize), else one expert at a time."""
        dev = next(iter(self.stacked(proj).values())).device
        if fast_dequant(dev, self.fmt):
            from ..kernels import moe_dequant  # imports triton

            ids = torch.tensor(experts, dtype=torch.int32).to(dev, non_blocking=True)
            return moe_dequant.dequantize_experts(self.fmt, self.stacked(proj), ids, self.shapes[proj], dtype)
        return torch.stack([self.weight(proj, e, dtype) for e in experts])

    def _project(self, proj: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """x times expert e's weight (+ bias), written as HF's module writes it (x·W or linear(x, W))."""
        w = self.weight(proj, e, x.dtype)
        y = x @ w.t() if self.transposed else nn.functional.linear(x, w)
        if self.r and not self.disable_adapters:  # shrink and expand on this expert's tokens only
            a, b = self.lora_A[proj][e], self.lora_B[proj][e]
            y = y + ((x.to(a.dtype) @ a.t()) @ b.t()).to(y.dtype) * self.scaling
        bias = self.bias(proj)
        return y if bias is None else y + bias[e]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """transformers' experts loop (Qwen3MoeExperts / GptOssExperts.forward), expert by expert in the
        same order and with the same operations, on each hit expert's dequantized weights."""
        if self.routing_log is not None:
            self.routing_log.append(top_k_index.detach().clone())
        path = experts_path(hidden_states, self.fmt, self.grouped)
        if path == GEMV:
            return self._gemv_forward(hidden_states, top_k_index, top_k_weights)
        if path == GROUPED:
            return self._grouped_forward(hidden_states, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            x = hidden_states[tok]
            y = self._project("down_proj", e, self.glu(self._project("gate_up_proj", e, x)))
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


    def _grouped_forward(self, h: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert, one grouped matmul per projection per chunk of hit experts. Each
        (token, slot) pair's output gets its own row and a token's k rows are summed at the end: an
        index_add_ of repeated tokens sums by atomics on a GPU, in any order, so a recompute under
        gradient checkpointing could route the next layer differently (and checkpoint refuses that)."""
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        tok_all, w_all = order // k, wts.reshape(-1)[order]
        ys = []
        chunk = self.chunk_experts(h.dtype)
        from ..kernels import settings

        if settings.current().moe_expert_chunk_mib:  # the budgeted chunks: bounds from one read of the counts
            for experts, lo, hi, group_ends, ids in _host_chunks(counts, self.num_experts, chunk, h.device):
                x = h[tok_all[lo:hi]]
                y = self._grouped_project("gate_up_proj", experts, x, group_ends, ids)
                y = self._grouped_project("down_proj", experts, self.glu(y), group_ends, ids)
                ys.append((y * w_all[lo:hi, None]).to(h.dtype))
            return _sum_pairs(ys, order, t, k, h)
        ends = torch.cumsum(counts, 0)
        hit = [e for e in counts.nonzero()[:, 0].tolist() if e < self.num_experts]  # E: "no expert", sorted last
        for c in range(0, len(hit), chunk):
            experts = hit[c:c + chunk]
            lo, hi = int(ends[experts[0]] - counts[experts[0]]), int(ends[experts[-1]])
            group_ends = (torch.cumsum(counts[experts], 0)).to(torch.int32)
            x = h[tok_all[lo:hi]]
            y = self._grouped_project("gate_up_proj", experts, x, group_ends)
            y = self._grouped_project("down_proj", experts, self.glu(y), group_ends)
            ys.append((y * w_all[lo:hi, None]).to(h.dtype))
        return _sum_pairs(ys, order, t, k, h)

    def chunk_experts(self, dtype: torch.dtype) -> int:
        """Hit experts the grouped path dequantizes at once: KernelSettings.moe_expert_chunk_mib's budget over
        one expert's larger projection in `dtype`, at least 1; without a budget, expert_chunk."""
        from ..kernels import settings

        mib = settings.current().moe_expert_chunk_mib
        if not mib:
            return self.expert_chunk
        per = max(n * k for n, k in self.shapes.values()) * torch.empty((), dtype=dtype).element_size()
        return max(1, (mib << 20) // per)

    def _grouped_project(self, proj: str, experts: list[int], x: torch.Tensor, ends: torch.Tensor,
                         ids: torch.Tensor | None = None) -> torch.Tensor:
        from .grouped_mm import frozen_grouped_mm, grouped_mm

        dt = x.dtype  # not x in the closure: ctx keeps it past checkpointing, every layer's inputs to the backward
        y = frozen_grouped_mm(x, lambda: self.weights(proj, experts, dt), ends)
        if self.r and not self.disable_adapters:
            lora_ids = torch.tensor(experts, device=x.device) if ids is None else ids
            a, b = self.lora_A[proj][lora_ids], self.lora_B[proj][lora_ids]  # [c, r, K], [c, N, r]
            s = grouped_mm(x.to(a.dtype), a.transpose(-2, -1), ends)
            y = y + (grouped_mm(s, b.transpose(-2, -1), ends)).to(y.dtype) * self.scaling
        bias = self.bias(proj)
        if bias is not None:
            if ids is None:
                rows = torch.repeat_interleave(torch.tensor(experts, device=x.device),
                                               torch.diff(ends, prepend=ends.new_zeros(1)))
            else:  # the budgeted chunks: no wait for the device (the output's size is the rows given)
                rows = torch.repeat_interleave(ids, torch.diff(ends, prepend=ends.new_zeros(1)), output_size=x.shape[0])
            y = y + bias[rows]
        return y

    def _gemv_forward(self, h: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        """Pairs sorted by expert, one grouped GEMV per projection; each pair's output in its own row, a
        token's slots summed after, as _grouped_forward does. Pairs of the "no expert" index E add nothing."""
        from ..kernels import moe_gemv

        rt = moe_gemv.route(idx, self.num_experts)
        y = self._gemv_project("gate_up_proj", h, rt.token, rt)
        y = self._gemv_project("down_proj", self.glu(y), None, rt)
        y = y * wts.reshape(-1)[rt.order, None]
        y = torch.where(rt.valid[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device))  # unwritten rows
        t, k = idx.shape
        return _sum_pairs([y.to(h.dtype)], rt.order, t, k, h)

    def _gemv_project(self, proj: str, x: torch.Tensor, rows: torch.Tensor | None, rt) -> torch.Tensor:
        """[P, N]: pair p's input (x[rows[p]], or x[p] if rows is None) times its expert's weight, + LoRA, + bias."""
        from ..kernels import moe_gemv, moe_lora

        y = moe_gemv.grouped_gemv(x, rows, rt, self.fmt, self.stacked(proj), self.shapes[proj])
        if self.r and not self.disable_adapters and moe_lora.supports(x):
            # Per pair, by Triton kernels: torch._grouped_mm syncs with the host, which CUDA graphs refuse.
            moe_lora.add_expert_lora(y, x, rows, rt.expert, self.lora_A[proj], self.lora_B[proj], self.scaling)
        elif self.r and not self.disable_adapters:  # CPU: per-expert shrink and expand on the slots' rows
            from .grouped_mm import grouped_mm

            xs = x if rows is None else x[rows]
            # One more group past the slots holds the "no expert" pairs (any factors: their rows are dropped).
            ids = torch.cat([rt.slot_expert, rt.slot_expert[:1]]).long()
            a, b = self.lora_A[proj][ids], self.lora_B[proj][ids]  # [S+1, r, K], [S+1, N, r]
            s = grouped_mm(xs.to(a.dtype), a.transpose(-2, -1), rt.ends)
            y = y + grouped_mm(s, b.transpose(-2, -1), rt.ends).to(y.dtype) * self.scaling
        bias = self.bias(proj)
        return y if bias is None else y + bias[rt.expert]


def _host_chunks(counts: torch.Tensor, num_experts: int, chunk: int, device):
    """(experts, lo, hi, group ends, expert ids) of each chunk of at most `chunk` hit experts, pairs sorted by
    expert: the bounds from one read of the counts (a host sync) instead of two a chunk, the small index tensors
    copied to the device without waiting for it. Pairs of the "no expert" index (num_experts) are left out."""
    n = counts.tolist()[:num_experts]
    starts = [0]
    for c in n:
        starts.append(starts[-1] + c)
    hit = [e for e, c in enumerate(n) if c]
    for i in range(0, len(hit), chunk):
        experts = hit[i:i + chunk]
        lo, hi = starts[experts[0]], starts[experts[-1] + 1]
        ends = [starts[e + 1] - lo for e in experts]
        yield (experts, lo, hi, torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True),
               torch.tensor(experts).to(device, non_blocking=True))


def _sum_pairs(ys: list[torch.Tensor], order: torch.Tensor, t: int, k: int, h: torch.Tensor) -> torch.Tensor:
    """[T, H]: pair outputs given in sorted order (ys, concatenated: the first rows of `order`; pairs past
    them add nothing) put back in (token, slot) order and summed over each token's k slots."""
    y = torch.cat(ys) if ys else h.new_zeros(0, h.shape[-1])
    per_pair = h.new_zeros(t * k, h.shape[-1]).index_copy(0, order[: y.shape[0]], y)
    return per_pair.view(t, k, -1).sum(1)


def quantize_experts(model: nn.Module, fmt="nvfp4") -> list[str]:
    """Replace every transformers experts module (a child named `experts` with 3-D gate_up_proj and
    down_proj) by a QuantExperts, in place; returns their names. Routers, shared experts and norms stay."""
    done = []
    for name, mod in list(model.named_modules()):
        child = getattr(mod, "experts", None)
        if isinstance(child, nn.Module) and not isinstance(child, QuantExperts) and \
                isinstance(getattr(child, "gate_up_proj", None), torch.Tensor):
            full = f"{name}.experts" if name else "experts"
            setattr(mod, "experts", QuantExperts.from_hf(child, fmt, full))
            done.append(full)
    return done
