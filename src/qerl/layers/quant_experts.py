"""QuantExperts: an MoE's experts in 4 bits, in transformers 5's fused 3-D layout.

transformers 5 keeps a layer's experts as two parameters, `gate_up_proj` [E, 2I, H] and `down_proj`
[E, H, I] (Qwen3-MoE, Mixtral, ...), called with the router's choice as
`experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`. Here each of the two is held as
its format's tensors stacked over the experts (NVFP4: packed codes [E, N, K/2], FP8 block scales
[E, N, K/16], one global scale per expert, gate|up sharing it as one fused projection), and the call
runs transformers' own loop over the active experts, each expert's weights dequantized when it is
hit: on the CPU, a loop over the active experts, never a dequantized copy of every expert (which
does not fit a large MoE). The router stays in the model's dtype and is not touched.

Not here yet: LoRA on the experts (PEFT's target_parameters), the GPU grouped path, gpt-oss's
MXFP4 repack, export of the stock layout.
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats import get_format

PROJECTIONS = ("gate_up_proj", "down_proj")


class QuantExperts(nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, fmt, act_fn, dtype: torch.dtype, name: str = "experts"):
        """gate_up [E, 2I, H], down [E, H, I]: the dense experts, quantized one expert at a time."""
        super().__init__()
        self.fmt = get_format(fmt) if isinstance(fmt, str) else fmt
        self.num_experts = gate_up.shape[0]
        self.act_fn, self.dtype, self.name = act_fn, dtype, name
        self.shapes = {"gate_up_proj": tuple(gate_up.shape[1:]), "down_proj": tuple(down.shape[1:])}
        for proj, w in zip(PROJECTIONS, (gate_up, down)):
            if w.shape[0] != self.num_experts:
                raise ValueError(f"{name}.{proj}: {w.shape[0]} experts, gate_up_proj has {self.num_experts}")
            per = []
            for e in range(self.num_experts):
                self.fmt.validate(w[e], f"{name}.{proj}[{e}]")
                gs = self.fmt.global_scale([w[e]]) if self.fmt.has_global_scale else None
                per.append(self.fmt.quantize(w[e], gs))
            for key in per[0]:
                self.register_buffer(f"{proj}_{key}", torch.stack([t[key] for t in per]))

    @classmethod
    def from_hf(cls, experts: nn.Module, fmt, name: str = "experts") -> "QuantExperts":
        """From a transformers experts module (its gate_up_proj / down_proj parameters and act_fn)."""
        missing = [p for p in PROJECTIONS if not isinstance(getattr(experts, p, None), torch.Tensor)]
        if missing:
            raise ValueError(f"{name} ({type(experts).__name__}): no 3-D {', '.join(missing)} parameter; QuantExperts "
                             "reads transformers 5's fused expert layout")
        w = experts.gate_up_proj
        return cls(w.detach(), experts.down_proj.detach(), fmt, experts.act_fn, w.dtype, name)

    def tensors(self, proj: str, e: int) -> dict[str, torch.Tensor]:
        pre = proj + "_"
        return {k[len(pre):]: b[e] for k, b in self._buffers.items() if k.startswith(pre)}

    def weight(self, proj: str, e: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Expert e's dequantized [N, K] weight of `proj`."""
        return self.fmt.dequantize(self.tensors(proj, e), self.shapes[proj], dtype or self.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """transformers' experts loop (Qwen3MoeExperts.forward), expert by expert in the same order and
        with the same operations, on each hit expert's dequantized weights."""
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit[:, 0].tolist():
            if e == self.num_experts:
                continue
            pos, tok = torch.where(mask[e])
            x = hidden_states[tok]
            gate, up = nn.functional.linear(x, self.weight("gate_up_proj", e, x.dtype)).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.weight("down_proj", e, x.dtype))
            y = y * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


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
