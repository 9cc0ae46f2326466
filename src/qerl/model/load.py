"""load_policy: a Hugging Face causal LM with quantized LoRA linears, built layer by layer.

The model skeleton is created on the meta device; then, one decoder layer at a
time, the targeted projections are read from safetensors, quantized on the
target device and installed, so peak memory is the quantized model plus about
one bf16 layer. A compressed-tensors checkpoint (as llm-compressor writes it) is
read directly: its packed tensors become the layer's buffers, never bf16.
"""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from ..formats import QuantizationError, get_format
from ..layers import QLoRALinear
from .architectures import DEFAULT_TARGETS, FUSED_GROUPS, TARGET_MODULES, check_architecture, normalize_targets
from .resolve import resolve_model
from .safetensors_reader import CheckpointError, SafetensorsCheckpoint

log = logging.getLogger(__name__)

CT_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}


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

    @property
    def config(self):
        return self.model.config

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def quantized_layers(model: nn.Module) -> Iterator[tuple[str, QLoRALinear]]:
    for name, m in model.named_modules():
        if isinstance(m, QLoRALinear):
            yield name, m


def checkpoint_format(config, source) -> tuple[str | None, list[str]]:
    """(format or None for a dense checkpoint, ignore list) from config.quantization_config."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None, []
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{source}/config.json: quantization_config.quant_method {q.get('quant_method')!r} is not supported "
                         "(qerl reads compressed-tensors NVFP4/MXFP4 checkpoints, or dense ones)")
    groups = q.get("config_groups") or {}
    fmts = {g.get("format") or q.get("format") for g in groups.values()} or {q.get("format")}
    if len(fmts) != 1 or next(iter(fmts)) not in CT_FORMATS:
        raise ValueError(f"{source}/config.json: quantization format {sorted(map(str, fmts))} is not supported; "
                         f"qerl reads {', '.join(CT_FORMATS)}")
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
) -> Policy:
    """Load a Llama / Qwen2 / Qwen3 causal LM with its targeted linears quantized + LoRA.

    quant: "nvfp4" | "mxfp4" | "nf4" | "bf16", or "auto" (the checkpoint's own format,
    nvfp4 for a dense checkpoint). lora_rank 0 gives a frozen quantized model.
    lora_alpha defaults to 2·rank. Embeddings, lm_head and norms stay in `dtype`.
    """
    from transformers import AutoConfig

    folder = resolve_model(name_or_path, revision=revision)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    check_architecture(config, str(folder))
    ckpt_fmt, ignore = checkpoint_format(config, folder)
    if quant == "auto":
        quant = ckpt_fmt or "nvfp4"
    if ckpt_fmt and quant != ckpt_fmt:
        raise ValueError(f"{folder} holds a compressed-tensors {ckpt_fmt} checkpoint; load it with quant={ckpt_fmt!r} "
                         f"(re-quantizing {ckpt_fmt} to {quant} would compound two rounding errors)")
    fmt = get_format(quant, double_quant=nf4_double_quant)
    targets = normalize_targets(target_modules)
    alpha = float(lora_alpha if lora_alpha is not None else 2 * lora_rank)
    device = torch.device(device)
    ckpt = SafetensorsCheckpoint(folder)
    model, cfg = _build_skeleton(config, dtype, trust_remote_code)

    done: set[str] = set()
    fallback: list[str] = []
    lora = dict(r=lora_rank, lora_alpha=alpha, lora_dropout=lora_dropout, dtype=dtype) if lora_rank else dict(dtype=dtype)
    n_layers = cfg.num_hidden_layers
    groups = [g for g in FUSED_GROUPS] + [(t,) for t in TARGET_MODULES if not any(t in g for g in FUSED_GROUPS)]
    for i in tqdm(range(n_layers), desc=f"loading {folder.name} as {quant}", disable=not progress, unit="layer"):
        for group in groups:
            members = [t for t in group if t in targets]
            if not members:
                continue
            names = [f"model.layers.{i}.{TARGET_MODULES[t]}" for t in members]
            if ckpt_fmt:
                layers = _load_compressed(ckpt, names, fmt, ignore, lora, device)
            else:
                layers = _quantize_group(ckpt, names, fmt, lora, device, fallback)
            for name, layer in zip(names, layers):
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, layer)
                done.update(f"{name}.{k}" for k in ("weight", "bias", *fmt.expected_shapes((1, fmt.block_size))))
                done.update(f"{name}.{k}" for k in ("weight_packed", "weight_scale", "weight_global_scale"))

    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, t in list(model.state_dict(keep_vars=True).items()):
        if name in done or ".lora_" in name or not t.is_meta:
            continue
        if name == "lm_head.weight" and tied and name not in ckpt:
            continue
        _set_tensor(model, name, ckpt.get(name, device), ckpt.path_of(name))
    if tied:
        model.tie_weights()
    _materialize_buffers(model, cfg, device)

    for n, p in model.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    tokenizer = _load_tokenizer(folder, trust_remote_code)
    model.eval()
    return Policy(model, tokenizer, folder, quant, lora_rank, alpha, lora_dropout, targets, fallback)


def _quantize_group(ckpt, names, fmt, lora, device, fallback):
    ws = [ckpt.get(f"{n}.weight", device) for n in names]
    biases = [ckpt.get(f"{n}.bias", device) if f"{n}.bias" in ckpt else None for n in names]
    ok = []
    for n, w in zip(names, ws):
        try:
            fmt.validate(w, n)
            ok.append(True)
        except QuantizationError as e:
            warnings.warn(f"{e}; leaving this layer in bf16 (as llm-compressor's ignore list would)", stacklevel=3)
            fallback.append(n)
            ok.append(False)
    good = [w for w, k in zip(ws, ok) if k]
    gs = fmt.global_scale(good) if good and fmt.has_global_scale else None
    out = []
    for n, w, b, k in zip(names, ws, biases, ok):
        f = fmt if k else get_format("bf16")
        out.append(QLoRALinear.from_weight(w, f, b, global_scale=gs if k else None, name=n, **lora))
    return out


def _load_compressed(ckpt, names, fmt, ignore, lora, device):
    out = []
    for n in names:
        bias = ckpt.get(f"{n}.bias", device) if f"{n}.bias" in ckpt else None
        if f"{n}.weight_packed" in ckpt:
            keys = fmt.expected_shapes((1, fmt.block_size))
            for k in keys:
                if f"{n}.{k}" not in ckpt:
                    raise CheckpointError(f"{ckpt.folder}: missing tensor {n}.{k} ({fmt.name} layer)")
            out_f, half_in = ckpt.shape(f"{n}.weight_packed")
            layer = QLoRALinear(half_in * 2, out_f, fmt, bias=bias is not None, device=device, **lora)
            layer.load_quantized({k: ckpt.get(f"{n}.{k}", device) for k in keys}, f"{ckpt.path_of(n + '.weight_packed')}: {n}")
            if bias is not None:
                layer.bias.data.copy_(bias)
        elif f"{n}.weight" in ckpt:  # left dense by the checkpoint's ignore list
            layer = QLoRALinear.from_weight(ckpt.get(f"{n}.weight", device), "bf16", bias, name=n, **lora)
        else:
            raise CheckpointError(f"{ckpt.folder}: missing tensor {n}.weight_packed (or {n}.weight)")
        out.append(layer)
    return out


def _materialize_buffers(model, cfg, device):
    """Non-persistent buffers (rotary inv_freq) are not in checkpoints: rebuild their modules."""
    for name, mod in list(model.named_modules()):
        if any(b is not None and b.is_meta for b in mod._buffers.values()):
            if type(mod).__name__.endswith("RotaryEmbedding"):
                with torch.device("cpu"):  # some versions take device=, some don't
                    new = type(mod)(config=cfg).to(device)
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, new)
            else:
                raise CheckpointError(f"buffer of {name} ({type(mod).__name__}) was not loaded")
    left = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise CheckpointError(f"tensors not found in the checkpoint: {left[:5]}")


def _load_tokenizer(folder, trust_remote_code):
    from transformers import AutoTokenizer

    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
