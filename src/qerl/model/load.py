"""load_policy: a Hugging Face causal LM with quantized LoRA linears, built layer by layer.

The model skeleton is created on the meta device; then, one decoder layer at a
time, the targeted projections are read from safetensors, quantized on the
target device and installed, so peak memory is the quantized model plus about
one bf16 layer. A compressed-tensors checkpoint (as llm-compressor writes it) is
read directly: its packed tensors become the layer's buffers, never bf16.

q|k|v and gate|up of a layer are loaded as fused groups (layers/fused_group.py)
when their rows concatenate exactly: the group's storage is allocated once and
each member is quantized (or read) straight into its rows.
"""

from __future__ import annotations

import copy
import logging
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from ..formats import QuantizationError, get_format
from ..layers import QLoRALinear
from ..layers.fused_group import QuantGroup, register, row_split, why_not_fusable
from .architectures import DEFAULT_TARGETS, check_architecture
from .family import family_of_model
from .resolve import resolve_model
from .safetensors_reader import CheckpointError, SafetensorsCheckpoint

log = logging.getLogger(__name__)

CT_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}
READS = ("qerl reads dense float weights (bf16/fp16/fp32 safetensors) and compressed-tensors "
         f"{'/'.join(CT_FORMATS)} checkpoints")
DENSE_DTYPES = ("BF16", "F16", "F32", "F64")
# tensor-name markers of quantized formats qerl does not read (checked on the tensors, not the label)
FOREIGN_MARKERS = (
    ((".absmax", ".quant_map", ".quant_state."), "bitsandbytes 4-bit (NF4/FP4: absmax/quant_state tensors)"),
    ((".SCB",), "bitsandbytes 8-bit (LLM.int8: SCB tensors)"),
    ((".weight_scale_inv",), "FP8 with block scales (weight_scale_inv tensors)"),
    ((".W_q",), "HQQ (W_q tensors)"),
)


@dataclass
class Policy:
    """The trainable policy: the model, its tokenizer, and how it was built."""

    model: nn.Module
    tokenizer: object | None
    source: Path
    quant: str
    lora_rank: int
    lora_alpha: float
    lora_dropout: float
    target_modules: tuple[str, ...]
    bf16_fallback: list[str] = field(default_factory=list)  # layers that could not be quantized
    modules_to_not_convert: tuple[str, ...] = ()  # the patterns of the linears kept in bf16 by choice

    @property
    def config(self):
        return self.model.config

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def quantized_layers(model: nn.Module) -> Iterator[tuple[str, QLoRALinear]]:
    for name, m in model.named_modules():
        if isinstance(m, QLoRALinear):
            yield name, m


def checkpoint_format(config, source, ckpt: SafetensorsCheckpoint) -> tuple[str | None, list[str]]:
    """(format or None for a dense checkpoint, ignore list), decided by the tensors themselves.

    config.json's quantization_config is only a label, and a stale one is common (a folder written by
    save_pretrained after loading a GGUF keeps quant_method "gguf" over dense bf16 weights): dense
    float projection weights load as dense whatever it says, with a note. Packed tensors must carry a
    compressed-tensors NVFP4/MXFP4 label; quantized tensors of any other format are refused by name."""
    label = _quant_label(config)
    method = label.get("quant_method")
    foreign = _foreign_format(ckpt, method)
    if foreign:
        raise ValueError(f"{source}: the weights are quantized as {foreign}; {READS}. Load the original "
                         "dense model, or dequantize it (e.g. transformers' from_pretrained, then save_pretrained)")
    if any(k.endswith(".weight_packed") for k in ckpt.keys()):
        return _compressed_format(label, source)
    if method == "mxfp4" and any(k.endswith("_proj_blocks") for k in ckpt.keys()):
        return None, []  # gpt-oss's own MXFP4 experts (read packed by _load_experts); the rest is dense
    if label:
        log.warning("%s/config.json: quantization_config (quant_method %r) does not match the tensors, which "
                    "are dense %s; loading them as a dense checkpoint and ignoring the label",
                    source, method, "/".join(sorted(_projection_dtypes(ckpt))))
    return None, []


def _quant_label(config) -> dict:
    q = getattr(config, "quantization_config", None)
    if q is None:
        return {}
    return dict(q) if isinstance(q, dict) else q.to_dict()


def _projection_dtypes(ckpt) -> set[str]:
    return {ckpt.dtype(k) for k in ckpt.keys() if k.endswith("_proj.weight")}


def _foreign_format(ckpt, method) -> str | None:
    """The name of the quantized format the tensors are in, when qerl cannot read it; else None."""
    keys = list(ckpt.keys())
    if any(k.endswith(".qweight") for k in keys):  # GPTQ and AWQ share qweight/qzeros/scales
        gptq = method == "gptq" or (method != "awq" and any(k.endswith(".g_idx") for k in keys))
        return ("GPTQ" if gptq else "AWQ") + " (qweight/qzeros/scales tensors)"
    for markers, name in FOREIGN_MARKERS:
        if any(k.endswith(m) or (m.endswith(".") and m in k) for k in keys for m in markers):
            return name
    packed = any(k.endswith(".weight_packed") for k in keys)
    odd = sorted(_projection_dtypes(ckpt) - set(DENSE_DTYPES))
    if odd and not packed:
        what = f"quant_method {method!r}" if method else "a format config.json does not name"
        return f"{what} (projection weights stored as {'/'.join(odd)})"
    return None


def _compressed_format(q: dict, source) -> tuple[str, list[str]]:
    """Packed tensors: the format named by the compressed-tensors label, which must be one qerl reads."""
    if q.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{source}: the safetensors hold packed (weight_packed) tensors but config.json's "
                         f"quantization_config.quant_method is {q.get('quant_method')!r}, not "
                         f"'compressed-tensors'; {READS}")
    groups = q.get("config_groups") or {}
    fmts = {g.get("format") or q.get("format") for g in groups.values()} or {q.get("format")}
    if len(fmts) != 1 or next(iter(fmts)) not in CT_FORMATS:
        raise ValueError(f"{source}/config.json: quantization format {sorted(map(str, fmts))} is not supported; "
                         f"{READS}")
    if q.get("quantization_status") not in (None, "compressed"):
        raise ValueError(f"{source}/config.json: quantization_status {q.get('quantization_status')!r}; expected 'compressed'")
    return CT_FORMATS[next(iter(fmts))], list(q.get("ignore") or [])


def _build_skeleton(config, dtype, trust_remote_code):
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, trust_remote_code=trust_remote_code)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, trust_remote_code=trust_remote_code)
    return model, cfg


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor, source) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    old = getattr(mod, attr)
    if tuple(old.shape) != tuple(value.shape):
        raise CheckpointError(f"{source}: tensor {name!r} has shape {list(value.shape)}, the model expects {list(old.shape)}")
    if isinstance(old, nn.Parameter):
        setattr(mod, attr, nn.Parameter(value.to(old.dtype), requires_grad=False))
    else:
        mod._buffers[attr] = value.to(old.dtype)


def load_policy(
    name_or_path: str,
    quant: str = "nvfp4",
    *,
    lora_rank: int = 32,
    lora_alpha: float | None = None,
    lora_dropout: float = 0.0,
    target_modules=DEFAULT_TARGETS,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    nf4_double_quant: bool = True,
    revision: str | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    fuse_groups: bool = True,
    modules_to_not_convert=None,
) -> Policy:
    """Load a causal LM of a supported family (model/families/) with its targeted linears quantized + LoRA.

    quant: "nvfp4" | "mxfp4" | "nf4" | "bf16", or "auto" (the checkpoint's own format,
    nvfp4 for a dense checkpoint). lora_rank 0 gives a frozen quantized model.
    lora_alpha defaults to 2·rank. Embeddings, lm_head and norms stay in `dtype`.
    fuse_groups: store q|k|v and gate|up as fused groups where exact (False: separate layers).
    modules_to_not_convert: linears kept in bf16 (still LoRA-trained; keep_in_bf16 says how names match).
    A compressed-tensors checkpoint keeps its own ignore list; a packed layer there cannot be un-quantized.
    """
    from transformers import AutoConfig

    from .adapter_start import adapter_folder, load_adapter_start

    if (adapter := adapter_folder(name_or_path)) is not None:  # a PEFT adapter folder: its base, then it
        return load_adapter_start(adapter, load_policy, quant, lora_rank=lora_rank, lora_alpha=lora_alpha,
                                  lora_dropout=lora_dropout, target_modules=target_modules, device=device,
                                  dtype=dtype, nf4_double_quant=nf4_double_quant, revision=revision,
                                  trust_remote_code=trust_remote_code, progress=progress, fuse_groups=fuse_groups,
                                  modules_to_not_convert=modules_to_not_convert)
    folder = resolve_model(name_or_path, revision=revision)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    family = check_architecture(config, str(folder))
    ckpt = SafetensorsCheckpoint(folder)
    ckpt_fmt, ignore = checkpoint_format(config, folder, ckpt)
    if quant == "auto":
        quant = ckpt_fmt or "nvfp4"
    if ckpt_fmt and quant != ckpt_fmt:
        raise ValueError(f"{folder} holds a compressed-tensors {ckpt_fmt} checkpoint; load it with quant={ckpt_fmt!r} "
                         f"(re-quantizing {ckpt_fmt} to {quant} would compound two rounding errors)")
    fmt = get_format(quant, double_quant=nf4_double_quant)
    targets = family.normalize_targets(target_modules)
    experts_lora = lora_rank if family.lora_on_experts(target_modules) else 0
    if experts_lora and lora_dropout:
        raise ValueError(f"lora_dropout {lora_dropout} with LoRA on the experts: PEFT's target_parameters LoRA has no "
                         "dropout (x cannot be factored out of W + BA), so its adapter would not load; use 0")
    alpha = float(lora_alpha if lora_alpha is not None else 2 * lora_rank)
    device = torch.device(device)
    model, cfg = _build_skeleton(config, dtype, trust_remote_code)
    family_of_model(model, str(folder))  # what transformers built is the family's own class and layers
    label = f"{folder}/config.json says {'/'.join(config.architectures or [config.model_type])}"
    _check_projection_biases(model, ckpt, cfg.num_hidden_layers, [family.module(0, t) for t in targets], label)

    keep = keep_in_bf16(modules_to_not_convert)
    _check_keep_patterns(modules_to_not_convert or [], keep, [n for n, _ in model.named_modules()])
    done: set[str] = set()
    fallback: list[str] = []
    lora = dict(r=lora_rank, lora_alpha=alpha, lora_dropout=lora_dropout, dtype=dtype) if lora_rank else dict(dtype=dtype)
    n_layers = cfg.num_hidden_layers
    fused = family.fused_groups
    groups = list(fused) + [(t,) for t in family.projections if not any(t in g for g in fused)]
    for i in tqdm(range(n_layers), desc=f"loading {folder.name} as {quant}", disable=not progress, unit="layer"):
        for group in groups:
            members = [t for t in group if t in targets]
            if not members:
                continue
            names = [family.module(i, t) for t in members]
            fuse = fuse_groups and len(group) > 1 and len(members) == len(group)
            if ckpt_fmt:
                packed = [n for n in names if keep(n) and f"{n}.weight_packed" in ckpt]
                if packed:
                    raise ValueError(f"modules_to_not_convert: {packed[0]} is quantized in {folder} (a compressed-"
                                     "tensors checkpoint); only its own ignore list keeps layers in bf16 there")
                layers, qgroup = _load_compressed(ckpt, names, fmt, ignore, lora, device, fuse)
            else:
                layers, qgroup = _quantize_group(ckpt, names, fmt, lora, device, fallback, fuse, keep)
            for name, layer in zip(names, layers):
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, layer)
                done.update(f"{name}.{k}" for k in ("weight", "bias", *fmt.expected_shapes((1, fmt.block_size))))
                done.update(f"{name}.{k}" for k in ("weight_packed", "weight_scale", "weight_global_scale"))
            if qgroup is not None:
                install_group(model, names, qgroup)
        if family.experts is not None:
            packed = ckpt_fmt and _compressed_experts_in(ckpt, family, i)
            done.update(_load_compressed_experts(model, ckpt, family, i, fmt, device) if packed
                        else _load_experts(model, ckpt, family, i, fmt, device))
            if experts_lora:
                model.get_submodule(f"model.layers.{i}.{family.experts.path}").add_lora(experts_lora, alpha, dtype)

    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, t in list(model.state_dict(keep_vars=True).items()):
        if name in done or ".lora_" in name or not t.is_meta:
            continue
        if name == "lm_head.weight" and tied and name not in ckpt:
            continue
        stored = family.checkpoint_name(name)  # Mixtral's router: block_sparse_moe.gate in the checkpoint
        if stored not in ckpt:
            raise CheckpointError(f"{label}, which has tensor {stored!r}; the checkpoint does not: the architecture "
                                  "label does not match the tensors")
        _set_tensor(model, name, ckpt.get(stored, device), ckpt.path_of(stored))
        done.add(stored)
    _check_all_used(ckpt, done, tied, label)
    if tied:
        model.tie_weights()
    _materialize_buffers(model, cfg, device)

    for n, p in model.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    tokenizer = _load_tokenizer(folder, trust_remote_code)
    model.eval()
    return Policy(model, tokenizer, folder, quant, lora_rank, alpha, lora_dropout,
                  targets + (("experts",) if experts_lora else ()), fallback, tuple(modules_to_not_convert or ()))


def _load_experts(model, ckpt, family, i, fmt, device) -> list[str]:
    """Layer i's experts into a QuantExperts; returns the checkpoint keys used. Read one expert at a time
    from the stock per-expert layout, or from transformers 5's fused 3-D tensors, and quantized; gpt-oss's
    MXFP4 `*_blocks` / `*_scales` are repacked as qerl's mxfp4 tensors (the same bytes), whatever `fmt`
    the rest of the model takes: re-quantizing them would compound two rounding errors."""
    from ..layers.quant_experts import PROJECTIONS, QuantExperts

    ex = family.experts
    module = f"model.layers.{i}.{ex.path}"
    base = family.checkpoint_name(module)
    skeleton = model.get_submodule(module)
    dtype = skeleton.gate_up_proj.dtype
    transposed = bool(getattr(skeleton, "is_transposed", False))
    n = getattr(model.config, ex.count)
    biases, keys = None, []
    if getattr(skeleton, "has_bias", False):
        keys = [f"{base}.{p}_bias" for p in PROJECTIONS]
        _require(ckpt, keys, family, n)
        biases = {p: ckpt.get(k, device) for p, k in zip(PROJECTIONS, keys)}
    if f"{base}.gate_up_proj_blocks" in ckpt:
        _install(model, module, _mxfp4_experts(ckpt, base, module, skeleton, biases, dtype, transposed, device))
        return keys + [f"{base}.{p}_{k}" for p in PROJECTIONS for k in ("blocks", "scales")]
    if f"{base}.gate_up_proj" in ckpt:
        keys += [f"{base}.gate_up_proj", f"{base}.down_proj"]
        gate_up, down = (ckpt.get(k, device) for k in keys[-2:])
        if transposed:  # held [E, K, N] (x·W): quantized along K
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    else:
        per = [f"{base}.{e}.{p}.weight" for e in range(n) for p in (ex.gate, ex.up, ex.down)]
        _require(ckpt, per, family, n)
        keys += per
        gate_up = torch.stack([torch.cat([ckpt.get(f"{base}.{e}.{ex.gate}.weight", device),
                                          ckpt.get(f"{base}.{e}.{ex.up}.weight", device)]) for e in range(n)])
        down = torch.stack([ckpt.get(f"{base}.{e}.{ex.down}.weight", device) for e in range(n)])
    q = QuantExperts.quantize(gate_up.to(dtype), down.to(dtype), fmt, skeleton._apply_gate, dtype, module, biases,
                              transposed)
    _install(model, module, q)
    return keys


def _compressed_experts_in(ckpt, family, i) -> bool:
    """Whether layer i's experts are packed per expert, as llm-compressor writes an MoE for vLLM."""
    ex = family.experts
    base = family.checkpoint_name(f"model.layers.{i}.{ex.path}")
    return ex.per_expert and f"{base}.0.{ex.gate}.weight_packed" in ckpt


def _load_compressed_experts(model, ckpt, family, i, fmt, device) -> list[str]:
    """Layer i's experts from a compressed-tensors checkpoint: each expert's packed gate, up and down
    (`<path>.<e>.<gate>.weight_packed` / weight_scale / weight_global_scale) stacked as QuantExperts holds
    them, the same bytes. gate|up is one projection with one global scale an expert, so an expert whose
    gate and up scales differ is refused (vLLM's fused MoE kernels need them equal too; llm-compressor
    writes them equal); re-quantizing would compound two rounding errors."""
    from ..layers.quant_experts import QuantExperts

    ex = family.experts
    module = f"model.layers.{i}.{ex.path}"
    base = family.checkpoint_name(module)
    skeleton = model.get_submodule(module)
    if getattr(skeleton, "has_bias", False) or getattr(skeleton, "is_transposed", False):
        raise ValueError(f"{ckpt.folder}: compressed-tensors experts of {family.name} (biased or transposed experts) "
                         "are not read; load the dense or stock checkpoint")
    n = getattr(model.config, ex.count)
    kinds = list(fmt.expected_shapes((1, fmt.block_size)))
    keys = [f"{base}.{e}.{p}.{k}" for e in range(n) for p in (ex.gate, ex.up, ex.down) for k in kinds]
    _require(ckpt, keys, family, n)

    def read(e, p):
        name = f"{base}.{e}.{p}"
        return {k: ckpt.get(f"{name}.{k}", device) for k in kinds}, layer_shape(ckpt, name)

    gate_up, down, shapes = [], [], {}
    for e in range(n):
        (g, gs), (u, us), (d, ds) = read(e, ex.gate), read(e, ex.up), read(e, ex.down)
        if "weight_global_scale" in g and not torch.equal(g["weight_global_scale"], u["weight_global_scale"]):
            raise CheckpointError(f"{ckpt.path_of(f'{base}.{e}.{ex.gate}.weight_packed')}: expert {e}'s "
                                  f"{ex.gate} and {ex.up} have different weight_global_scale "
                                  f"({float(g['weight_global_scale'].reshape(-1)[0]):.6g} and "
                                  f"{float(u['weight_global_scale'].reshape(-1)[0]):.6g}); qerl holds gate|up with one "
                                  "global scale an expert (as vLLM's fused MoE does): re-export with them fused")
        if gs[1] != us[1]:
            raise CheckpointError(f"{ckpt.folder}: expert {e}'s {ex.gate} {list(gs)} and {ex.up} {list(us)} differ")
        gate_up.append({k: (g[k] if k == "weight_global_scale" else torch.cat([g[k], u[k]])) for k in kinds})
        down.append(d)
        shapes = {"gate_up_proj": (gs[0] + us[0], gs[1]), "down_proj": ds}
    want = tuple(skeleton.gate_up_proj.shape[1:])
    if shapes["gate_up_proj"] != want:
        raise CheckpointError(f"{ckpt.folder}: {base} holds experts of gate|up {list(shapes['gate_up_proj'])}; the "
                              f"config gives {list(want)}")
    tensors = {p: {k: torch.stack([t[k] for t in ts]) for k in kinds}
               for p, ts in (("gate_up_proj", gate_up), ("down_proj", down))}
    _install(model, module, QuantExperts(tensors, shapes, fmt, skeleton._apply_gate, skeleton.gate_up_proj.dtype,
                                         module))
    return keys


def _mxfp4_experts(ckpt, base, module, skeleton, biases, dtype, transposed, device):
    """gpt-oss's stock MXFP4 experts: blocks [E, N, K/32, 16] (two E2M1 codes a byte, low nibble first)
    and E8M0 scales [E, N, K/32] are, reshaped, qerl's mxfp4 weight_packed [E, N, K/2] and weight_scale."""
    from ..layers.quant_experts import PROJECTIONS, QuantExperts

    tensors, shapes = {}, {}
    for p in PROJECTIONS:
        blocks, scales = ckpt.get(f"{base}.{p}_blocks", device), ckpt.get(f"{base}.{p}_scales", device)
        e, rows, groups, width = blocks.shape
        if width != 16 or tuple(scales.shape) != (e, rows, groups):
            raise CheckpointError(f"{ckpt.folder}: {base}.{p}_blocks {list(blocks.shape)} / _scales "
                                  f"{list(scales.shape)} are not gpt-oss's MXFP4 layout [E, N, K/32, 16] / [E, N, K/32]")
        tensors[p] = {"weight_packed": blocks.view(torch.uint8).reshape(e, rows, groups * 16),
                      "weight_scale": scales.view(torch.uint8)}
        shapes[p] = (rows, groups * 32)
    q = QuantExperts(tensors, shapes, "mxfp4", skeleton._apply_gate, dtype, module, biases, transposed)
    want = tuple(skeleton.gate_up_proj.shape[1:])
    have = shapes["gate_up_proj"][::-1] if transposed else shapes["gate_up_proj"]
    if have != want:
        raise CheckpointError(f"{ckpt.folder}: {base}.gate_up_proj_blocks holds experts of {list(have)}; the config "
                              f"gives {list(want)}")
    return q


def _require(ckpt, keys, family, n) -> None:
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise CheckpointError(f"{ckpt.folder}: missing expert tensor {missing[0]} ({family.name}, {n} experts)")


def _install(model, module: str, q) -> None:
    parent, _, attr = module.rpartition(".")
    setattr(model.get_submodule(parent), attr, q)


def _check_projection_biases(model, ckpt, n_layers, modules, label) -> None:
    """The skeleton's biased projections (Qwen2's q/k/v) must have biases in the checkpoint and
    unbiased ones must not: else the architecture label and the tensors disagree.
    modules: the targeted projections' module names in layer 0."""
    for i in range(n_layers):
        for m in modules:
            name = m.replace("model.layers.0.", f"model.layers.{i}.", 1)
            wants = getattr(model.get_submodule(name), "bias", None) is not None
            if wants != (f"{name}.bias" in ckpt):
                model_side, ckpt_side = ("has a", "lacks") if wants else ("has no", "has")
                raise CheckpointError(f"{label}, whose {name} {model_side} bias; the checkpoint {ckpt_side} "
                                      f"{name}.bias: the architecture label does not match the tensors")


def _check_all_used(ckpt, used: set[str], tied: bool, label) -> None:
    """Tensors the architecture has no place for (Qwen3's q_norm under a Llama label) would be
    silently dropped, leaving a different model: refuse them."""
    extra = [k for k in ckpt.keys() if k not in used and not k.endswith("rotary_emb.inv_freq")
             and not (tied and k == "lm_head.weight")]
    if extra:
        raise CheckpointError(f"{label}, which has no place for {len(extra)} checkpoint tensor(s), e.g. "
                              f"{', '.join(sorted(extra)[:3])}: the architecture label does not match the tensors")


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
        if store is not fmt:
            t = store.from_checkpoint(fmt.to_checkpoint(t, shape), shape, name)
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


def _check_keep_patterns(patterns, keep, module_names) -> None:
    """A pattern that names no module of the model is a typo, not a choice."""
    for p in patterns:
        if not any(keep_in_bf16([p])(n) for n in module_names):
            raise ValueError(f"modules_to_not_convert: {p!r} matches no module of the model (e.g. "
                             f"{module_names[-2] if len(module_names) > 1 else 'lm_head'})")


def _quantize_group(ckpt, names, fmt, lora, device, fallback, fuse, keep=lambda name: False):
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


def _load_compressed(ckpt, names, fmt, ignore, lora, device, fuse):
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
        fuse = fuse and _shared_tensors_agree(ckpt, names, fmt, shapes)
        return build_projections(names, shapes, biases, fmt, lora, device,
                                 lambda i: _read_packed(ckpt, names[i], keys, fmt, device), fuse)
    out = []
    for n, p, bias in zip(names, packed, biases):
        if p:
            out += build_projections([n], [layer_shape(ckpt, n)], [bias], fmt, lora, device,
                                     lambda i, n=n: _read_packed(ckpt, n, keys, fmt, device), False)[0]
        else:  # left dense by the checkpoint's ignore list
            out.append(QLoRALinear.from_weight(ckpt.get(f"{n}.weight", device), "bf16", bias, name=n, **lora))
    return out, None


def _read_packed(ckpt, name, keys, fmt, device) -> dict[str, torch.Tensor]:
    """One layer's packed tensors, in the format's storage order."""
    label = f"{ckpt.path_of(name + '.weight_packed')}: {name}"
    return fmt.from_checkpoint({k: ckpt.get(f"{name}.{k}", device) for k in keys}, layer_shape(ckpt, name), label)


def layer_shape(ckpt, name: str) -> tuple[int, int]:
    """[out, in] of a packed layer (two E2M1 codes per byte)."""
    out_f, half_in = ckpt.shape(f"{name}.weight_packed")
    return out_f, 2 * half_in


def _shared_tensors_agree(ckpt, names, fmt, shapes) -> bool:
    """Whether the per-tensor quantities (NVFP4's global scale) are identical across the members, as
    llm-compressor writes fused groups; a checkpoint that differs keeps its layers separate."""
    split = row_split(fmt, [s[0] for s in shapes], shapes[0][1])
    if isinstance(split, str) or len({s[1] for s in shapes}) != 1:
        return False
    for key in (k for k, ext in split.items() if ext is None):
        ts = [ckpt.get(f"{n}.{key}").view(torch.uint8) for n in names]
        if any(not torch.equal(t, ts[0]) for t in ts[1:]):
            return False
    return True


def _materialize_buffers(model, cfg, device):
    """Non-persistent buffers (rotary inv_freq) are not in checkpoints: rebuild their modules."""
    for name, mod in list(model.named_modules()):
        if any(b is not None and b.is_meta for b in mod._buffers.values()):
            if type(mod).__name__.endswith("RotaryEmbedding"):
                with torch.device("cpu"):  # some versions take device=, some don't
                    new = type(mod)(config=cfg).to(device)
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, new)
            elif all(b is None or not b.is_meta or hasattr(mod, f"scalar_{k}") for k, b in mod._buffers.items()):
                for k, b in list(mod._buffers.items()):  # a constant kept beside its buffer (Gemma's embed_scale)
                    if b is not None and b.is_meta:
                        mod._buffers[k] = torch.tensor(getattr(mod, f"scalar_{k}"), dtype=b.dtype, device=device)
            else:
                raise CheckpointError(f"buffer of {name} ({type(mod).__name__}) was not loaded")
    left = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise CheckpointError(f"tensors not found in the checkpoint: {left[:5]}")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def require_tokenizer(folder) -> None:
    """Commands that write or read text need the folder's tokenizer: say so before any work."""
    folder = Path(folder)
    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{folder}: no tokenizer ({', '.join(TOKENIZER_FILES)}); generation and rewards need "
                                "one: save it there (tokenizer.save_pretrained) or use the original model folder")


def _load_tokenizer(folder, trust_remote_code):
    from transformers import AutoTokenizer

    if not any((folder / f).exists() for f in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
