"""humming-kernels' MoE GEMM as a candidate for an MoE layer's 4-bit experts (issue 47 section 3): vLLM's fused-MoE
shape of the problem, tokens indexed per expert in blocks, both projections in one launch each.

The routing is laid out as vLLM's `moe_align_block_size` does: the (token, slot) pairs sorted by expert, each
expert's run padded to the kernel's block of rows with an out-of-range id, one expert id a block (`align`, here in
torch: it reads the block count on the host, so this path is a bench candidate, not a graph-capturable one). The
gate_up GEMM reads each token's row once per slot (top_k), the GLU runs in torch, the down GEMM reads the GLU rows,
and the k outputs of a token are weighted and summed in fp32. Measured against QuantExperts' GEMV and grouped paths by
`qerl bench moe --humming`; not yet run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .humming_backend import CT_CONFIGS

INDEXED = {"gemm_type": "indexed"}


@dataclass(frozen=True)
class Alignment:
    sorted_ids: torch.Tensor  # int32 [P]: flat (token, slot) ids grouped by expert, each run padded with T*k
    expert_ids: torch.Tensor  # int32 [P / block]: the expert of each block of rows
    num_tokens_padded: torch.Tensor  # int32 scalar: P


def align(topk_ids: torch.Tensor, num_experts: int, block: int) -> Alignment:
    """topk_ids [T, k] -> the pairs sorted by expert (ascending pair id within an expert), each expert's run padded to
    a multiple of `block` with the out-of-range id T*k; experts no pair chose take no block, and a pair routed to
    no expert (the id num_experts, as QuantExperts accepts) takes no row."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    flat = torch.where(flat < num_experts, flat, num_experts)  # sorts after every expert; dropped below
    kept = int(counts.sum())
    padded = (counts + block - 1) // block * block
    order = torch.argsort(flat, stable=True)[:kept]  # pair ids, grouped by expert, ascending within each
    start = torch.cumsum(counts, 0) - counts  # first position of each expert in `order`
    start_padded = torch.cumsum(padded, 0) - padded
    experts_of = flat[order]
    rank = torch.arange(kept, device=flat.device) - start[experts_of]
    total = int(padded.sum())
    sorted_ids = torch.full((total,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[start_padded[experts_of] + rank] = order.to(torch.int32)
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=flat.device, dtype=torch.int32),
                                         padded // block)
    return Alignment(sorted_ids, expert_ids, torch.tensor(total, dtype=torch.int32, device=flat.device))


def combine(rows: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, routed: torch.Tensor | None = None
            ) -> torch.Tensor:
    """[T*k, H] outputs of the (token, slot) pairs -> [T, H]: each token's k rows weighted and summed in fp32; a pair
    not routed (routed [T, k] False: its row was never written) adds nothing."""
    t, k = weights.shape
    r = rows.view(t, k, -1).float()
    if routed is not None:
        r = torch.where(routed.unsqueeze(-1), r, 0.0)
    return (r * weights.float().unsqueeze(-1)).sum(1).to(dtype)


@dataclass
class HummingExperts:
    """An MoE layer's NVFP4 experts (QuantExperts' stacked compressed-tensors tensors) in humming's expert layout."""

    gate_up: torch.nn.Module
    down: torch.nn.Module
    num_experts: int
    glu: object

    @classmethod
    def from_quant_experts(cls, q) -> "HummingExperts":
        from humming.layer import HummingLayer

        if getattr(q.fmt, "name", "nvfp4") != "nvfp4":
            raise ValueError(f"humming experts: format {q.fmt.name!r}; this candidate takes NVFP4")
        if q.has_bias or q.r:
            raise ValueError(f"humming experts ({q.name}): biases or LoRA on the experts; this candidate runs the "
                             "frozen base only")
        layers = []
        for proj in ("gate_up_proj", "down_proj"):
            n, k = q.shapes[proj]
            t = {key: getattr(q, f"{proj}_{key}") for key in ("weight_packed", "weight_scale", "weight_global_scale")}
            t["weight_global_scale"] = t["weight_global_scale"].reshape(q.num_experts).float()
            dev = t["weight_packed"].device
            with torch.device(dev):
                layer = HummingLayer(shape_n=n, shape_k=k, weight_config=dict(CT_CONFIGS["nvfp4"]),
                                     num_experts=q.num_experts, torch_dtype=torch.bfloat16)
            layer.load_from_tensors(t)
            layer.transform()
            layers.append(layer)
        return cls(layers[0], layers[1], q.num_experts, q.glu)

    def _config(self, layer, tokens: int, device) -> dict:
        from humming.tune import get_heuristics_config

        return get_heuristics_config(layer.humming_config, tokens, gemm_type="indexed", device=device)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        t, k = topk_ids.shape
        x = x.to(torch.bfloat16).contiguous()
        c1 = self._config(self.gate_up, t * k, x.device)  # humming's heuristics count routed rows (tokens x top-k)
        a1 = align(topk_ids, self.num_experts, c1["block_shape"][0])
        y = self.gate_up(x, sorted_ids=a1.sorted_ids, expert_ids=a1.expert_ids, num_tokens_padded=a1.num_tokens_padded,
                         top_k=k, compute_config=INDEXED, tuning_config=c1)
        h = self.glu(y).to(torch.bfloat16).contiguous()
        c2 = self._config(self.down, t * k, x.device)
        a2 = a1 if c2["block_shape"][0] == c1["block_shape"][0] else align(topk_ids, self.num_experts,
                                                                            c2["block_shape"][0])
        out = self.down(h, sorted_ids=a2.sorted_ids, expert_ids=a2.expert_ids, num_tokens_padded=a2.num_tokens_padded,
                        top_k=1, compute_config=INDEXED, tuning_config=c2)
        return combine(out, weights, x.dtype, topk_ids < self.num_experts)
