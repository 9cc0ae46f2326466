"""A frozen input embedding stored in NVFP4 (the `embed_4bit` option).

Why. The embedding table is read a few rows a step but held whole: gpt-oss-20b's [201088, 2880] is 1.08 GiB in
bf16, a tenth of the model's 4-bit weights, and the largest piece left of a 14 GiB step after the experts
(bench/step_plan.py). In NVFP4 it is 0.30 GiB. A lookup gathers its rows' packed bytes and scales and
dequantizes only those, so rollouts (in CUDA graphs: no host sync, no host-to-device copy) and the update's
forward see the same rows. The cost is the table's own 4-bit rounding on every input, so it is an option,
off by default, as `lm_head_4bit` is. A head tied to the embedding shares its table: that model is refused.

The module keeps nn.Embedding's interface where readers need it (num_embeddings, embedding_dim, `weight`
as the dequantized table, made on access), and its state dict holds that dequantized `weight`, so an export
writes a table transformers loads.
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats import get_format
from ..formats.e2m1 import E2M1_VALUES, unpack_codes


ROWS_AT_ONCE = 4096  # ids dequantized at a time: 4096 x 2880 (gpt-oss) x 8 bytes ~ 94 MB of fp32 intermediates


class QuantEmbedding(nn.Module):
    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype: torch.dtype,
                 embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = packed.shape[0], packed.shape[1] * 2
        # the rows' dtype, as an empty float buffer: model.to(dtype) converts it with the model's other tensors
        self.register_buffer("dtype_probe", torch.empty(0, dtype=dtype, device=packed.device), persistent=False)
        # scales as bytes: gathering rows of a float8 tensor is not supported on every device
        self.register_buffer("weight_packed", packed, persistent=False)
        self.register_buffer("weight_scale", scale.view(torch.uint8), persistent=False)
        # the global scale's float32 bits: model.to(bf16) converts float buffers, which would round it
        self.register_buffer("weight_global_scale_bits", global_scale.to(torch.float32).reshape(1).view(torch.int32),
                             persistent=False)
        # the E2M1 values on the table's device, made once: a lookup inside a CUDA graph copies nothing in
        self.register_buffer("values", E2M1_VALUES.to(packed.device), persistent=False)
        # Gemma's scaled embedding multiplies its rows by sqrt(hidden) inside the module
        self.register_buffer("embed_scale", None if embed_scale is None else embed_scale.detach().clone(),
                             persistent=False)
        self._register_state_dict_hook(_dense_weight_in_state_dict)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, fmt_name: str = "nvfp4") -> "QuantEmbedding":
        if type(emb) is not nn.Embedding and not hasattr(emb, "embed_scale"):
            raise ValueError(f"embed_4bit: the input embedding is a {type(emb).__name__}, not an nn.Embedding or "
                             "a scaled embedding (Gemma's); qerl cannot store it in 4 bits")
        if fmt_name != "nvfp4":
            raise ValueError(f"embed_4bit: format {fmt_name!r}; the 4-bit embedding is NVFP4")
        w = emb.weight.detach()
        fmt = get_format(fmt_name)
        fmt.validate(w, "embed_tokens.weight")
        t = fmt.quantize(w)
        scale = getattr(emb, "embed_scale", None)
        return cls(t["weight_packed"], t["weight_scale"], t["weight_global_scale"], w.dtype,
                   scale if isinstance(scale, torch.Tensor) else None)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized rows of `ids` (any shape) -> [*ids.shape, embedding_dim], as NVFP4's dequantize
        gives them (formats/nvfp4.py), without the table's other rows. In chunks of ROWS_AT_ONCE ids: the fp32
        intermediates take ~8 bytes an element, a whole prefill's tokens at once would be a large transient."""
        flat = ids.reshape(-1)
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=dtype or self.dtype, device=self.device)
        gs = self.weight_global_scale_bits.view(torch.float32)
        for i in range(0, flat.numel(), ROWS_AT_ONCE):  # shapes fixed by ids' size: the same steps in a graph
            part = flat[i:i + ROWS_AT_ONCE]
            codes = unpack_codes(self.weight_packed[part]).int()  # int32 indices: half of long's transient
            vals = self.values[codes].unflatten(-1, (self.embedding_dim // 16, 16))
            del codes
            scale = self.weight_scale[part].view(torch.float8_e4m3fn).to(torch.float32).div_(gs)
            out[i:i + ROWS_AT_ONCE] = vals.mul_(scale.unsqueeze(-1)).flatten(-2)
        return out.view(*ids.shape, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.rows(ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale.to(h.dtype)
        return h

    @property
    def weight(self) -> torch.Tensor:
        """The whole dequantized table [V, D] in the model's dtype, made on each access (not kept): qerl's own
        code reads `device`/`dtype` instead; this is for readers that want the table."""
        return self.rows(torch.arange(self.num_embeddings, device=self.weight_packed.device))

    @property
    def device(self) -> torch.device:
        return self.weight_packed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.dtype_probe.dtype

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fmt=nvfp4 (frozen)"


def _dense_weight_in_state_dict(module, state, prefix, local_metadata):
    state[prefix + "weight"] = module.weight


def quantize_embedding(model: nn.Module, fmt_name: str = "nvfp4") -> QuantEmbedding:
    """Replace the model's input embedding by its 4-bit copy, in place; returns it. A model whose lm_head
    is its embedding (tie_word_embeddings) is refused: the head would keep the bf16 table anyway."""
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        return emb
    head = getattr(model, "lm_head", None)
    # the head's own parameter, not `.weight`: a 4-bit head (lm_head_4bit, applied first) would dequantize itself whole
    head_w = head._parameters.get("weight") if isinstance(head, nn.Module) else None
    if getattr(model.config, "tie_word_embeddings", False) or head_w is emb.weight:
        raise ValueError("embed_4bit: this model ties its lm_head to the input embedding (tie_word_embeddings), "
                         "so the bf16 table stays for the head and 4 bits would save nothing; use lm_head_4bit "
                         "or neither")
    q = QuantEmbedding.from_embedding(emb, fmt_name)
    model.set_input_embeddings(q)
    return q


def table_device_dtype(emb: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where an input embedding computes and in which dtype, without making a 4-bit table's dense copy."""
    if isinstance(emb, QuantEmbedding):
        return emb.device, emb.dtype
    return emb.weight.device, emb.weight.dtype
