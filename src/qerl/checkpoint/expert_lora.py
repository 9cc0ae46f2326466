"""LoRA on MoE experts in PEFT's files: `target_parameters`, as PEFT's ParamWrapper stores it.

PEFT wraps each targeted 3-D parameter once, nesting the wrappers in target_parameters' order: with
["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], gate_up_proj's factors sit under
`<experts>.base_layer.lora_{A,B}.weight` and down_proj's under `<experts>.lora_{A,B}.weight`. Each
factor is one flat nn.Linear over all experts: A [r·E, K] with expert e's rows at e·r … e·r + r − 1,
and B [N, r·E] with expert e's column j at j·E + e (PEFT's get_delta_factors: reshape (N, r, E)).
QuantExperts keeps them per expert, A [E, r, K] and B [E, N, r]; these functions convert both ways.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.quant_experts import PROJECTIONS, QuantExperts

PREFIX = "base_model.model."
NESTING = {"gate_up_proj": ".base_layer", "down_proj": ""}  # inner wrapper first, as target_parameters lists


def lora_experts(model: nn.Module) -> dict[str, QuantExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts) and m.r}


def target_parameters(model: nn.Module) -> list[str]:
    """PEFT's target_parameters for the experts with LoRA (their path below the layer, both projections)."""
    paths = sorted({n.split(".", 3)[3] for n in lora_experts(model)})  # model.layers.<i>.<path>
    return [f"{p}.{proj}" for p in paths for proj in PROJECTIONS]


def key(name: str, proj: str, which: str) -> str:
    return f"{PREFIX}{name}{NESTING[proj]}.{which}.weight"


def peft_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The experts' factors as PEFT's flat tensors."""
    out = {}
    for name, q in lora_experts(model).items():
        for proj in PROJECTIONS:
            a, b = q.lora_A[proj].detach(), q.lora_B[proj].detach()
            e, r, k = a.shape
            out[key(name, proj, "lora_A")] = a.reshape(e * r, k).to("cpu", copy=True)
            out[key(name, proj, "lora_B")] = b.permute(1, 2, 0).reshape(b.shape[1], r * e).to("cpu", copy=True)
    return out


def split_peft_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]):
    """(the tensors that are not the experts', {experts name: {(proj, which): tensor}})."""
    names = {n for n, m in model.named_modules() if isinstance(m, QuantExperts)}
    wanted = {key(n, p, w): (n, p, w) for n in names for p in PROJECTIONS for w in ("lora_A", "lora_B")}
    rest, experts = {}, {}
    for k, t in tensors.items():
        if k in wanted:
            n, p, w = wanted[k]
            experts.setdefault(n, {})[(p, w)] = t
        else:
            rest[k] = t
    return rest, experts


def load_peft_tensors(model: nn.Module, experts: dict, r: int, alpha: float, scaling: float, source) -> None:
    """Put PEFT's flat expert factors into the QuantExperts (LoRA added where missing); every shape
    is checked before anything changes."""
    from .safetensors_reader import CheckpointError

    mods = dict(model.named_modules())
    staged = []
    for name, parts in experts.items():
        q = mods[name]
        for proj in PROJECTIONS:
            n, k = q.shapes[proj]
            a, b = parts.get((proj, "lora_A")), parts.get((proj, "lora_B"))
            if a is None or b is None:
                raise CheckpointError(f"{source}: missing {key(name, proj, 'lora_A' if a is None else 'lora_B')}")
            want_a, want_b = (q.num_experts * r, k), (n, r * q.num_experts)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise CheckpointError(f"{source}: {name} {proj}: lora_A {list(a.shape)}, lora_B {list(b.shape)}; "
                                      f"{q.num_experts} experts of [{n}, {k}] at r={r} need {list(want_a)}, "
                                      f"{list(want_b)}")
            staged.append((q, proj, a.reshape(q.num_experts, r, k), b.reshape(n, r, q.num_experts).permute(2, 0, 1)))
    with torch.no_grad():
        for q, proj, a, b in staged:
            if q.r != r:
                q.add_lora(r, alpha)
            q.lora_alpha, q.scaling = float(alpha), float(scaling)
            q.lora_A[proj].copy_(a)
            q.lora_B[proj].copy_(b)
            q.lora_A[proj].requires_grad_(True)
            q.lora_B[proj].requires_grad_(True)
