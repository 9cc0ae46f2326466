"""compressed-tensors checkpoints (what vLLM and llm-compressor read and write): a quantized policy written as
one, and its packed layers and MoE experts read back (the same bytes, never re-quantized).

The layout is llm-compressor's NVFP4A16 / MXFP4A16 output: per quantized Linear
`weight_packed`, `weight_scale` (+ `weight_global_scale` for NVFP4), everything
else dense, and a `quantization_config` in config.json. We write it ourselves
(rather than through compressed-tensors' ModelCompressor) because our layers
already hold exactly those bytes; compressing again would need a dense model.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from ..layers import QLoRALinear
from ..layers.fused_group import row_split
from ..layers.qlora_linear import standalone
from ..layers.quant_experts import QuantExperts
from .atomic import SHARD_BYTES, atomic_folder, entries, write_sharded
from .export import quant_heads
from .safetensors_reader import CheckpointError

log = logging.getLogger(__name__)
_WEIGHT_ARGS = {
    "nvfp4": {"strategy": "tensor_group", "group_size": 16, "scale_dtype": "torch.float8_e4m3fn"},
    "mxfp4": {"strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"},
}


def _ct_version() -> str:
    try:
        from importlib.metadata import version

        return version("compressed-tensors")
    except Exception:
        return "0.19.0"  # the version llm-compressor 0.14 writes with


def quantization_config(fmt: str, ignore: list[str]) -> dict:
    if fmt not in _WEIGHT_ARGS:
        raise ValueError(f"compressed-tensors has no format for {fmt!r}; write nvfp4 or mxfp4")
    weights = {
        "num_bits": 4, "type": "float", "symmetric": True, "dynamic": False,
        "actorder": None, "block_structure": None, "observer": "memoryless_minmax", "observer_kwargs": {},
        "zp_dtype": None, **_WEIGHT_ARGS[fmt],
    }  # fmt: skip
    name = f"{fmt}-pack-quantized"
    return {
        "config_groups": {"group_0": {"format": name, "targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None}},
        "format": name,
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": _ct_version(),
    }


def compressed_state_dict(model: torch.nn.Module, fmt: str, dtype: torch.dtype | None = None
                          ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(tensors to write, ignore list) as llm-compressor writes them for the same model: the packed layers'
    bytes, every other tensor dense in `dtype` (the base's; None: as held), and ignore = the Linear modules
    left dense (the base's own, e.g. lm_head, and the layers kept in bf16), by their full names. A 4-bit head
    (lm_head_4bit) is packed under lm_head, as llm-compressor writes a quantized head.
    LoRA factors are not included, nor listed: they are not modules of the base."""
    from ..layers.quant_experts import QuantExperts

    def dense(t):
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    out: dict[str, torch.Tensor] = {}
    ignore: list[str] = []
    owned: set[str] = set()
    heads = quant_heads(model)
    for name, m in model.named_modules():
        if any(name.startswith(o + ".") for o in owned):
            continue  # inside a layer of ours: its LoRA factors (nn.Linear) are no module of the base
        if isinstance(m, QuantExperts):
            owned.add(name)
            out.update(_expert_tensors(model, name, m, fmt))
        elif isinstance(m, QLoRALinear):
            owned.add(name)
            head = name in heads
            name = heads.get(name, name)  # a 4-bit head (lm_head.layer) as the Linear it replaces: lm_head
            if m.fmt.name == fmt:  # in the checkpoint's byte order (the layer may keep a kernel's)
                for k, t in m.checkpoint_tensors().items():
                    out[f"{name}.{k}"] = t
            elif m.fmt.name == "bf16" or head:  # a head in another format (NVFP4 in an MXFP4 policy): the
                out[f"{name}.weight"] = dense(m.dequantized_weight(m.dtype))  # values it computes with, dense
                ignore.append(name)
            else:
                raise ValueError(f"{name}: layer is {m.fmt.name}; a {fmt} checkpoint cannot hold it")
            if m.bias is not None:
                out[f"{name}.bias"] = dense(m.bias)
        elif isinstance(m, torch.nn.Linear):
            ignore.append(name)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for k, t in model.state_dict().items():
        mod = k.rpartition(".")[0]
        if mod in owned or any(k.startswith(o + ".") for o in owned):
            continue
        if tied and k == "lm_head.weight":
            continue
        out[k] = dense(t)
    if any(isinstance(m, QuantExperts) for m in model.modules()):  # an MoE: the stock names (Mixtral's
        from ..model.family import family_of_model                   # block_sparse_moe), as its experts'

        name = family_of_model(model).checkpoint_name
        out, ignore = {name(k): t for k, t in out.items()}, [name(n) for n in ignore]
    # One owned copy each: group members' tensors are views into shared storage (their global
    # scale one tensor), which safetensors refuses or would write whole.
    return {k: standalone(v) for k, v in out.items()}, ignore


def base_dtype(policy, model) -> torch.dtype:
    """The dtype of the base's dense tensors: its folder's config.json `dtype` (`torch_dtype` before
    transformers 5), else the model config's. A policy computing in fp32 still writes a bf16 base's
    norms, embeddings and kept layers in bf16, as llm-compressor does (they hold bf16 values)."""
    recorded = None
    src = getattr(policy, "source", None)
    if src:
        try:
            cfg = json.loads((Path(src) / "config.json").read_text())
            recorded = cfg.get("dtype") or cfg.get("torch_dtype")
        except (OSError, ValueError, AttributeError):
            recorded = None
    name = recorded or getattr(model.config, "dtype", None) or "bfloat16"
    dt = name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) and dt.is_floating_point else torch.bfloat16


def _expert_tensors(model, name: str, m, fmt: str) -> dict[str, torch.Tensor]:
    """An MoE layer's 4-bit experts in the per-expert layout llm-compressor writes and vLLM reads
    (`<path>.<e>.<gate>.weight_packed`, ...): gate|up split back into its halves, each half keeping the
    expert's one global scale. LoRA on experts is not part of the base checkpoint."""
    from ..model.family import family_of_model

    family = family_of_model(model)
    ex = family.experts
    if m.fmt.name != fmt:
        raise ValueError(f"{name}: experts are {m.fmt.name}; a {fmt} checkpoint cannot hold them")
    if m.transposed or m.has_bias or not ex.per_expert:
        raise ValueError(f"{name}: {family.name}'s experts (transposed, biased, interleaved gate|up) have no "
                         "per-expert compressed-tensors layout; export them merged (qerl export: a dense folder)")
    base = family.checkpoint_name(name)
    half = m.shapes["gate_up_proj"][0] // 2
    out = {}
    for e in range(m.num_experts):
        gu, d = m.tensors("gate_up_proj", e), m.tensors("down_proj", e)
        for proj, rows in ((ex.gate, slice(0, half)), (ex.up, slice(half, 2 * half))):
            out.update({f"{base}.{e}.{proj}.{k}": (t if k == "weight_global_scale" else t[rows])
                        for k, t in gu.items()})
        out.update({f"{base}.{e}.{ex.down}.{k}": t for k, t in d.items()})
    return out


def save_compressed(policy, out_dir: str | Path, fmt: str | None = None) -> Path:
    """Write policy's frozen base as a compressed-tensors checkpoint folder (atomically): what llm-compressor
    writes for the same model (its ignore list, dense tensors in the base's dtype)."""
    model = policy.model if hasattr(policy, "model") else policy
    fmt = fmt or getattr(policy, "quant", None)
    if fmt is None:
        raise ValueError("save_compressed: pass fmt='nvfp4' or 'mxfp4' for a bare model")
    dtype = base_dtype(policy, model)
    tensors, ignore = compressed_state_dict(model, fmt, dtype)
    cfg = model.config.to_diff_dict()  # what save_pretrained writes (llm-compressor saves through it)
    cfg.pop("quantization_config", None)
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = str(dtype).removeprefix("torch.")  # the tensors' dtype, not the one the policy computed in
    cfg["quantization_config"] = quantization_config(fmt, ignore)
    if quant_heads(model):  # a tied model's 4-bit head is a copy of the table, no longer the embedding itself
        cfg["tie_word_embeddings"] = False
    with atomic_folder(out_dir) as tmp:
        write_sharded(tmp, entries(tensors))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))
        src = Path(getattr(policy, "source", "") or "")
        if (src / "generation_config.json").exists():
            shutil.copy(src / "generation_config.json", tmp)
        tok = getattr(policy, "tokenizer", None)
        if tok is not None:
            tok.save_pretrained(tmp)
    return Path(out_dir)


# ---- reading -------------------------------------------------------------------------------
def read_packed(ckpt, name, keys, fmt, device) -> dict[str, torch.Tensor]:
    """One layer's packed tensors, in the format's storage order (each in the shape and dtype the format
    stores: `stored_as`, the rule the experts follow too)."""
    label = f"{ckpt.path_of(name + '.weight_packed')}: {name}"
    shape = layer_shape(ckpt, name)
    want = fmt.expected_shapes(shape)
    return fmt.from_checkpoint({k: stored_as(ckpt, f"{name}.{k}", *want[k], device) for k in keys}, shape, label)


def layer_shape(ckpt, name: str) -> tuple[int, int]:
    """[out, in] of a packed layer (two E2M1 codes per byte)."""
    out_f, half_in = ckpt.shape(f"{name}.weight_packed")
    return out_f, 2 * half_in


def shared_tensors_agree(ckpt, names, fmt, shapes) -> bool:
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


def compressed_experts_in(ckpt, family, i) -> bool:
    """Whether layer i's experts are packed per expert, as llm-compressor writes an MoE for vLLM."""
    ex = family.experts
    base = family.checkpoint_name(f"model.layers.{i}.{ex.path}")
    return ex.per_expert and f"{base}.0.{ex.gate}.weight_packed" in ckpt


def read_compressed_experts(model, ckpt, family, i, fmt, device):
    """(QuantExperts, checkpoint keys used) of layer i's experts from a compressed-tensors checkpoint: each expert's packed gate, up and down
    (`<path>.<e>.<gate>.weight_packed` / weight_scale / weight_global_scale) stacked as QuantExperts holds
    them, the same bytes. gate|up is one projection with one global scale an expert, so an expert whose
    gate and up scales differ is refused (vLLM's fused MoE kernels need them equal too; llm-compressor
    writes them equal); re-quantizing would compound two rounding errors."""
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
    require_experts(ckpt, keys, family, n)

    def read(e, p):
        name = f"{base}.{e}.{p}"
        shape = layer_shape(ckpt, name)
        want = fmt.expected_shapes(shape)
        return {k: stored_as(ckpt, f"{name}.{k}", *want[k], device) for k in kinds}, shape

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
    return QuantExperts(tensors, shapes, fmt, skeleton._apply_gate, skeleton.gate_up_proj.dtype, module), keys


def stored_as(ckpt, key: str, shape, dtype, device) -> torch.Tensor:
    """A packed tensor in the shape and dtype the format stores. One rule for every packed tensor (a layer's,
    an expert's): a float tensor in another float dtype whose values the format's dtype holds exactly (a
    weight_scale saved in fp32, every value an FP8-E4M3 one) is converted, the same numbers, and said once a
    folder; any other dtype or shape is refused, naming the file, the tensor and the dtype the format stores
    (the layer would compute with it, or fail in the first forward)."""
    t = ckpt.get(key, device)
    where = f"{ckpt.path_of(key)}: tensor {key!r}"
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{where} has shape {list(t.shape)}; the format stores {list(shape)}")
    if t.dtype == dtype:
        return t
    if t.is_floating_point() and dtype.is_floating_point:
        c = t.to(dtype)
        if torch.equal(c.to(t.dtype), t):  # exactly representable: lossless
            said = ckpt.__dict__.setdefault("converted_dtypes", set())
            if (t.dtype, dtype) not in said:
                said.add((t.dtype, dtype))
                log.warning("%s is %s where the format stores %s; every value is exactly one, so it is read "
                            "converted (the same numbers), as is any other tensor of this folder stored so", where,
                            t.dtype, dtype)
            return c
        raise CheckpointError(f"{where} is {t.dtype}, expected {dtype}, and holds values {dtype} cannot represent "
                              "exactly: re-export it in its format's dtype")
    raise CheckpointError(f"{where} is {t.dtype}, expected {dtype} (the dtype the format stores): re-export it in "
                          "its format's dtype")


def require_experts(ckpt, keys, family, n) -> None:
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise CheckpointError(f"{ckpt.folder}: missing expert tensor {missing[0]} ({family.name}, {n} experts)")
