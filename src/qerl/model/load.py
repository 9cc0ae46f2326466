"""load_policy: a Hugging Face causal LM with quantized LoRA linears, built layer by layer.

The model skeleton is created on the meta device; then, one decoder layer at a
time, the targeted projections are read from safetensors, quantized on the
target device and installed, so peak memory is the quantized model plus about
one bf16 layer. A compressed-tensors checkpoint (as llm-compressor writes it) is
read directly: its packed tensors become the layer's buffers, never bf16. Each
checkpoint format is read in checkpoint/ (detect.py says which a folder holds,
moe_experts.py reads the experts); the layers are built in model/projections.py.

q|k|v and gate|up of a layer are loaded as fused groups (layers/fused_group.py)
when their rows concatenate exactly: the group's storage is allocated once and
each member is quantized (or read) straight into its rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint.detect import checkpoint_format
from ..checkpoint.moe_experts import layer_experts
from ..checkpoint.safetensors_reader import CheckpointError, SafetensorsCheckpoint
from ..formats import get_format
from ..layers import QLoRALinear
from .architectures import DEFAULT_TARGETS, check_architecture
from .family import family_of_model
from .projections import check_keep_patterns, install_group, keep_in_bf16, load_compressed_group, quantize_group
from .resolve import resolve_model


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

    @property
    def repack_seconds(self) -> float:
        """Time the load spent turning checkpoint bytes into the device kernels' layout (MMA or humming's)."""
        return sum(getattr(m, "repack_seconds", 0.0) for _, m in quantized_layers(self.model))

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def quantized_layers(model: nn.Module) -> Iterator[tuple[str, QLoRALinear]]:
    for name, m in model.named_modules():
        if isinstance(m, QLoRALinear):
            yield name, m


def build_skeleton(config, dtype, trust_remote_code):
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


def set_tensor(model: nn.Module, name: str, value: torch.Tensor, source) -> None:
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
    model, cfg = build_skeleton(config, dtype, trust_remote_code)
    family_of_model(model, str(folder))  # what transformers built is the family's own class and layers
    label = f"{folder}/config.json says {'/'.join(config.architectures or [config.model_type])}"
    _check_projection_biases(model, ckpt, cfg.num_hidden_layers, [family.module(0, t) for t in targets], label)
    _check_projection_shapes(model, ckpt, cfg.num_hidden_layers, [family.module(0, t) for t in targets], config)

    keep = keep_in_bf16(modules_to_not_convert)
    check_keep_patterns(modules_to_not_convert or [], keep, [n for n, _ in model.named_modules()])
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
                layers, qgroup = load_compressed_group(ckpt, names, fmt, ignore, lora, device, fuse)
            else:
                layers, qgroup = quantize_group(ckpt, names, fmt, lora, device, fallback, fuse, keep)
            for name, layer in zip(names, layers):
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, layer)
                done.update(f"{name}.{k}" for k in ("weight", "bias", *fmt.expected_shapes((1, fmt.block_size))))
                done.update(f"{name}.{k}" for k in ("weight_packed", "weight_scale", "weight_global_scale"))
            if qgroup is not None:
                install_group(model, names, qgroup)
        if family.experts is not None:
            q, keys = layer_experts(model, ckpt, family, i, fmt, device, compressed=bool(ckpt_fmt))
            install_module(model, f"model.layers.{i}.{family.experts.path}", q)
            done.update(keys)
            if experts_lora:
                model.get_submodule(f"model.layers.{i}.{family.experts.path}").add_lora(experts_lora, alpha, dtype)

    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if ckpt_fmt and "lm_head.weight_packed" in ckpt:  # a quantized head (lm_head_4bit, or llm-compressor's)
        if keep("lm_head"):
            raise ValueError(f"modules_to_not_convert: lm_head is quantized in {folder} (a compressed-tensors "
                             "checkpoint); only its own ignore list keeps layers in bf16 there")
        done.update(_load_packed_head(model, ckpt, fmt, ignore, dtype, device))
        tied = False  # the head is its own packed bytes, not the embedding table
    for name, t in list(model.state_dict(keep_vars=True).items()):
        if name in done or ".lora_" in name or not t.is_meta:
            continue
        if name == "lm_head.weight" and tied and name not in ckpt:
            continue
        stored = family.checkpoint_name(name)  # Mixtral's router: block_sparse_moe.gate in the checkpoint
        if stored not in ckpt:
            raise CheckpointError(f"{label}, which has tensor {stored!r}; the checkpoint does not: the architecture "
                                  "label does not match the tensors")
        set_tensor(model, name, ckpt.get(stored, device), ckpt.path_of(stored))
        done.add(stored)
    _check_all_used(ckpt, done, tied, label)
    if tied:
        model.tie_weights()
    materialize_buffers(model, cfg, device)
    if device.type == "cuda":
        from ..kernels import plan_copies

        plan_copies(model)  # whether humming's weight copies fit: decided here, never at a first call

    for n, p in model.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    tokenizer = _load_tokenizer(folder, trust_remote_code)
    model.eval()
    return Policy(model, tokenizer, folder, quant, lora_rank, alpha, lora_dropout,
                  targets + (("experts",) if experts_lora else ()), fallback, tuple(modules_to_not_convert or ()))


def _load_packed_head(model, ckpt, fmt, ignore, dtype, device) -> set[str]:
    """model.lm_head as the QuantHead the packed lm_head tensors hold (the head a policy with lm_head_4bit
    computed with, written by save_compressed; or llm-compressor's quantized head); returns the keys read.
    Missing tensors, or shapes and dtypes the format does not store, are refused naming file and tensor."""
    from ..checkpoint.compressed_tensors import layer_shape
    from ..layers.quant_head import QuantHead

    want = tuple(model.lm_head.weight.shape)
    if tuple(layer_shape(ckpt, "lm_head")) != want:
        raise CheckpointError(f"{ckpt.path_of('lm_head.weight_packed')}: tensor 'lm_head.weight_packed' holds a head "
                              f"of {list(layer_shape(ckpt, 'lm_head'))} (weight_packed "
                              f"{list(ckpt.shape('lm_head.weight_packed'))}, two codes a byte); the config gives "
                              f"{list(want)}")
    if "lm_head.bias" in ckpt:
        raise CheckpointError(f"{ckpt.path_of('lm_head.bias')}: tensor 'lm_head.bias' beside a packed head; qerl's "
                              "4-bit head has no bias")
    (layer,), _ = load_compressed_group(ckpt, ["lm_head"], fmt, ignore, dict(dtype=dtype), device, False)
    model.lm_head = QuantHead(layer)  # frozen, no LoRA: as quantize_lm_head leaves it
    return {f"lm_head.{k}" for k in fmt.expected_shapes((1, fmt.block_size))}


def install_module(model, module: str, q) -> None:
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


def _check_projection_shapes(model, ckpt, n_layers, modules, config) -> None:
    """Each targeted projection as stored ([out, in]; a packed one's from its weight_packed) is the shape the
    config gives: the layers take the checkpoint's shape, so an o_proj stored [48, 64] under hidden 64
    loaded and failed only in the first forward."""
    from ..checkpoint.compressed_tensors import layer_shape

    for i in range(n_layers):
        for m in modules:
            name = m.replace("model.layers.0.", f"model.layers.{i}.", 1)
            want = getattr(model.get_submodule(name), "weight", None)
            if f"{name}.weight_packed" in ckpt:
                key, got = f"{name}.weight_packed", layer_shape(ckpt, name)
            elif f"{name}.weight" in ckpt:
                key, got = f"{name}.weight", ckpt.shape(f"{name}.weight")
            else:
                continue  # missing: named where it is read
            if want is not None and tuple(got) != tuple(want.shape):
                shown = (f"holds a weight of {list(got)} (weight_packed {list(ckpt.shape(key))}, two codes a byte)"
                         if key.endswith("_packed") else f"has shape {list(got)}")
                raise CheckpointError(f"{ckpt.path_of(key)}: tensor {key!r} {shown}; the config gives "
                                      f"{list(want.shape)} (hidden_size {getattr(config, 'hidden_size', '?')})")


def _check_all_used(ckpt, used: set[str], tied: bool, label) -> None:
    """Tensors the architecture has no place for (Qwen3's q_norm under a Llama label) would be
    silently dropped, leaving a different model: refuse them."""
    extra = [k for k in ckpt.keys() if k not in used and not k.endswith("rotary_emb.inv_freq")
             and not (tied and k == "lm_head.weight")]
    if extra:
        raise CheckpointError(f"{label}, which has no place for {len(extra)} checkpoint tensor(s), e.g. "
                              f"{', '.join(sorted(extra)[:3])}: the architecture label does not match the tensors")


def materialize_buffers(model, cfg, device):
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
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    check_chat_template(tok, folder)
    return tok


def check_chat_template(tok, folder) -> None:
    """A chat template the Jinja sandbox refuses (or cannot parse) is named now, with the file it came from,
    rather than as a traceback at the first prompt. Rendering in transformers' sandbox runs no code: an
    unsafe attribute access is a SecurityError there."""
    if not getattr(tok, "chat_template", None):
        return
    from jinja2.exceptions import SecurityError, TemplateSyntaxError

    folder = Path(folder)
    where = (f"{folder / 'chat_template.jinja'}" if (folder / "chat_template.jinja").exists()
             else f"{folder / 'tokenizer_config.json'}: chat_template")
    try:
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except SecurityError as e:
        raise ValueError(f"{where}: the chat template does what the Jinja sandbox refuses ({str(e).rstrip('.')}); "
                         "none of it ran: use the model's original template") from None
    except TemplateSyntaxError as e:
        raise ValueError(f"{where}: the chat template is not valid Jinja (line {e.lineno}: {e.message})") from None
    except Exception:  # noqa: BLE001 - a template refusing this sample (raise_exception, a role it lacks) is its own
        pass
