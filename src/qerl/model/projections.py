"""A decoder layer's targeted projections as QLoRALinear layers: quantized here from dense weights (a group
sharing one global scale, layers the user keeps in bf16 left out), or built from a compressed-tensors
checkpoint's packed bytes; fused into one group (q|k|v, gate|up) where the rows concatenate exactly.
The loader (model/load.py) and the random builder (model/random_init.py) build their layers here."""

from __future__ import annotations

import re
import time
import warnings
from typing import Callable

import torch
from torch import nn

from ..checkpoint.compressed_tensors import layer_shape, read_packed, shared_tensors_agree
from ..checkpoint.safetensors_reader import CheckpointError
from ..formats import QuantizationError, get_format
from ..layers import QLoRALinear
from ..layers.fused_group import QuantGroup, register, why_not_fusable


def build_projections(
    names: list[str], shapes: list[tuple[int, int]], biases: list[torch.Tensor | None], fmt, lora: dict, device,
    tensors_of: Callable[[int], dict[str, torch.Tensor]], fuse: bool,
) -> tuple[list[QLoRALinear], QuantGroup | None]:
    """QLoRALinear layers for `names` ([out, in] shapes), fused into one group when `fuse` and their
    rows concatenate exactly. tensors_of(i) gives member i's quantized tensors (storage order of
    `fmt`), one member at a time; they are copied into its rows, so the group's bytes exist once.

    The layers store their weights in the order the device's kernel reads (`kernels.storage_format`:
    NVFP4's MMA layout on a GPU that runs it), repacked here member by member; a weight the layout
    cannot hold (a zero or negative block scale) keeps the standard order, with a warning."""
    from ..kernels import storage_format

    store = storage_format(fmt, shapes[0], device)
    if any(storage_format(fmt, s, device) is fmt for s in shapes):
        store = fmt
    try:
        return _build(names, shapes, biases, store, lora, device, tensors_of, fuse, fmt)
    except QuantizationError as e:
        if store is fmt:
            raise
        warnings.warn(f"{e}; these layers keep the standard {fmt.name} layout (the Triton kernels)", stacklevel=3)
        return _build(names, shapes, biases, fmt, lora, device, tensors_of, fuse, fmt)


def _build(names, shapes, biases, store, lora, device, tensors_of, fuse, fmt):
    layers = [QLoRALinear(k, n, store, bias=b is not None, device=device, defer_storage=True, **lora)
              for (n, k), b in zip(shapes, biases)]
    group = QuantGroup(layers, names) if fuse and why_not_fusable(layers) is None else None
    for i, (name, layer, b, shape) in enumerate(zip(names, layers, biases, shapes)):
        t = tensors_of(i)
        if store is not fmt:  # the checkpoint's bytes into the kernel's layout, timed (Policy.repack_seconds)
            t0 = time.perf_counter()
            t = store.from_checkpoint(fmt.to_checkpoint(t, shape), shape, name)
            if t["weight_packed"].is_cuda:
                torch.cuda.synchronize(t["weight_packed"].device)
            layer.repack_seconds = time.perf_counter() - t0
        layer.load_quantized(t, name)
        if b is not None:
            with torch.no_grad():
                layer.bias.copy_(b)
    return layers, group


def install_group(model: nn.Module, names: list[str], group: QuantGroup) -> None:
    parent = names[0].rpartition(".")[0]
    register(model.get_submodule(parent), tuple(n.rpartition(".")[2] for n in names), group)


def keep_in_bf16(patterns) -> Callable[[str], bool]:
    """Whether a linear's module path is in `patterns` (transformers' modules_to_not_convert; llm-compressor's
    ignore): a pattern matches the path or its end at a dot ('lm_head', 'layers.27.mlp.down_proj',
    'down_proj'); 're:<regex>' matches the path from its start (llm-compressor's re.match)."""
    pats = list(patterns or [])
    regexes = [re.compile(p[3:]) for p in pats if p.startswith("re:")]
    plain = [p for p in pats if not p.startswith("re:")]

    def keep(name: str) -> bool:
        return any(name == p or name.endswith("." + p) for p in plain) or any(r.match(name) for r in regexes)
    return keep


def check_keep_patterns(patterns, keep, module_names) -> None:
    """A pattern that names no module of the model is a typo, not a choice."""
    for p in patterns:
        if not any(keep_in_bf16([p])(n) for n in module_names):
            raise ValueError(f"modules_to_not_convert: {p!r} matches no module of the model (e.g. "
                             f"{module_names[-2] if len(module_names) > 1 else 'lm_head'})")


def quantize_group(ckpt, names, fmt, lora, device, fallback, fuse, keep=lambda name: False):
    ws = [ckpt.get(f"{n}.weight", device) for n in names]
    biases = [ckpt.get(f"{n}.bias", device) if f"{n}.bias" in ckpt else None for n in names]
    ok = []
    for n, w in zip(names, ws):
        if keep(n):  # the user's choice: no warning, not a fallback
            ok.append(False)
            continue
        try:
            fmt.validate(w, n)
            ok.append(True)
        except QuantizationError as e:
            warnings.warn(f"{e}; leaving this layer in bf16 (as llm-compressor's ignore list would)", stacklevel=3)
            fallback.append(n)
            ok.append(False)
    good = [w for w, k in zip(ws, ok) if k]
    gs = fmt.global_scale(good) if good and fmt.has_global_scale else None
    if all(ok):
        return build_projections(names, [tuple(w.shape) for w in ws], biases, fmt, lora, device,
                                 lambda i: fmt.quantize(ws[i], gs), fuse)
    out = []
    for n, w, b, k in zip(names, ws, biases, ok):
        f = fmt if k else get_format("bf16")
        out.append(QLoRALinear.from_weight(w, f, b, global_scale=gs if k else None, name=n, **lora))
    return out, None


def load_compressed_group(ckpt, names, fmt, ignore, lora, device, fuse):
    biases = [ckpt.get(f"{n}.bias", device) if f"{n}.bias" in ckpt else None for n in names]
    keys = fmt.expected_shapes((1, fmt.block_size))
    packed = [f"{n}.weight_packed" in ckpt for n in names]
    for n, p in zip(names, packed):
        for k in keys if p else ():
            if f"{n}.{k}" not in ckpt:
                raise CheckpointError(f"{ckpt.folder}: missing tensor {n}.{k} ({fmt.name} layer)")
        if not p and f"{n}.weight" not in ckpt:
            raise CheckpointError(f"{ckpt.folder}: missing tensor {n}.weight_packed (or {n}.weight)")
    if all(packed):
        shapes = [layer_shape(ckpt, n) for n in names]
        fuse = fuse and shared_tensors_agree(ckpt, names, fmt, shapes)
        return build_projections(names, shapes, biases, fmt, lora, device,
                                 lambda i: read_packed(ckpt, names[i], keys, fmt, device), fuse)
    out = []
    for n, p, bias in zip(names, packed, biases):
        if p:
            out += build_projections([n], [layer_shape(ckpt, n)], [bias], fmt, lora, device,
                                     lambda i, n=n: read_packed(ckpt, n, keys, fmt, device), False)[0]
        else:  # left dense by the checkpoint's ignore list
            out.append(QLoRALinear.from_weight(ckpt.get(f"{n}.weight", device), "bf16", bias, name=n, **lora))
    return out, None
