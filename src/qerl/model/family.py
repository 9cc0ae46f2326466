"""One description per model family: what the loader, the engine, the trainer's masks and export read.

A `Family` says what differs between decoder layers of the families qerl runs: the projections
and how the checkpoint names them (separate q/k/v or one fused `qkv_proj`), the norms a layer has
and where they sit, q/k norms, the activation's attribute, how sliding windows are assigned to
layers, whether rotary tables differ per layer type. Everything numeric (rotary frequencies,
partial rotary, scaled embeddings, attention scaling) is read from the transformers modules
themselves, so the description stays small. The families live one per file in `families/`.

The gate (`family_of_config`, `family_of_model`) checks what is built: the config's model_type,
the architecture label against it, and the classes transformers built; a model none of the
families describes is refused by name, never run through another family's layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

QKV = ("q", "k", "v")
NORM_FORMS = ("llama", "offset", "fp32")
GATE_UP = ("gate", "up")
LLAMA_PROJECTIONS = {
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
}  # fmt: skip


class UnsupportedModelError(ValueError):
    """A model (config, class or layer) that no family describes, or a setting a family does not run."""


@dataclass(frozen=True)
class Norms:
    """Attribute names of a decoder layer's norms by where they sit (None: the layer has none there).

    Llama: input_layernorm before attention, post_attention_layernorm before the MLP. Gemma 3 adds
    norms on the attention and MLP outputs (four a layer); Olmo 2 has only those two (post-norm)."""
    attn_in: str | None = "input_layernorm"
    attn_out: str | None = None
    mlp_in: str | None = "post_attention_layernorm"
    mlp_out: str | None = None


@dataclass(frozen=True)
class Experts:
    """An MoE layer's experts: where they sit and how a checkpoint names each expert's projections
    (the stock per-expert layout, `<path>.<e>.<gate>.weight`; transformers 5 fuses them on load)."""
    path: str = "mlp.experts"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    count: str = "num_experts"  # the config field holding the number of experts
    intermediate: str = "moe_intermediate_size"  # the config field holding each expert's intermediate width
    per_expert: bool = True     # the stock checkpoint's layout: one tensor per expert, or the fused 3-D
                                # tensors (gpt-oss: gate_up_proj [E, K, N] or its MXFP4 *_blocks/*_scales)
    bias: bool = False          # each expert's projections have biases (gpt-oss)
    # the format the family's checkpoints ship the experts in, kept whatever the rest of the model takes
    # (gpt-oss: MXFP4, repacked as qerl's mxfp4, never re-quantized); None: the model's own quant
    checkpoint_format: str | None = None


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]        # config.model_type values
    causal_lm: str                      # the transformers class the loader builds and the engine accepts
    decoder_layer: str                  # the class of each of its decoder layers
    projections: Mapping[str, str] = field(default_factory=lambda: dict(LLAMA_PROJECTIONS))  # short -> module
    qkv: tuple[str, ...] = QKV          # the projections giving q, k, v (one fused name: split by heads)
    gate_up: tuple[str, ...] = GATE_UP  # the projections giving gate, up (one fused name: split in halves)
    fused_groups: tuple[tuple[str, ...], ...] = (QKV, GATE_UP)  # members qerl stores as one group
    aliases: Mapping[str, str] = field(default_factory=dict)  # target names of other families -> ours
    norms: Norms = Norms()
    qk_norm: str | None = None          # "head": per head after the reshape; "width": over all heads
    # how its RMSNorms compute (AQN adds Z to the effective weight, rollout/forward.py restates each):
    # "llama" w * x_hat.to(dtype) (the decode glue's fused norm), "offset" (x_hat * (1 + w)).to(dtype)
    # (Gemma 3), "fp32" (w * x_hat).to(dtype) with x_hat in fp32 (Olmo 2, gpt-oss)
    norm_form: str = "llama"
    act: str = "act_fn"                 # the MLP's activation attribute
    windows_from: str = "layer_types"   # "layer_types": config.layer_types picks sliding layers; "every_layer"
    rope_per_layer_type: bool = False   # the rotary module takes a layer_type (its own tables per type)
    rope_halves: bool = False           # the rotary module gives cos/sin for one half (gpt-oss), used on both
    sinks: bool = False                 # attention's per-head sink logit joins each softmax (gpt-oss)
    experts: Experts | None = None      # an MoE's experts (4-bit QuantExperts; LoRA on them if targeted)
    renames: tuple[tuple[str, str], ...] = ()  # (module path piece, the checkpoint's): Mixtral's block_sparse_moe
    check: Callable | None = None       # check(config) -> None or the reason a config is not run
    tested_against: str = ""            # README: what the family's tests compare with

    def __post_init__(self):
        if self.norm_form not in NORM_FORMS:
            raise ValueError(f"family {self.name}: norm_form {self.norm_form!r} is not one of {NORM_FORMS}")

    @property
    def llama_norm(self) -> bool:
        """Its norms compute w * x_hat.to(dtype): the decode glue's fused norm restates them."""
        return self.norm_form == "llama"

    @property
    def norm_class(self) -> str:
        """The class name of its RMSNorm (transformers names it after the model: LlamaRMSNorm, Olmo2RMSNorm)."""
        return self.decoder_layer.removesuffix("DecoderLayer") + "RMSNorm"

    def module(self, i: int, target: str) -> str:
        return f"model.layers.{i}.{self.projections[target]}"

    def checkpoint_name(self, name: str) -> str:
        """A module or tensor path as the stock checkpoint spells it (transformers renames on load)."""
        for ours, theirs in self.renames:
            name = name.replace(ours, theirs)
        return name

    def attr(self, target: str) -> str:
        return self.projections[target].rpartition(".")[2]

    def normalize_targets(self, targets) -> tuple[str, ...]:
        """Short names ('q'), module names ('q_proj', 'self_attn.q_proj') or another family's names
        (Llama's q/k/v on Phi-3's fused qkv_proj) -> this family's short names."""
        by_attr = {self.attr(t): t for t in self.projections}
        out = []
        for t in targets:
            leaf = t.split(".")[-1]
            key = by_attr.get(leaf, leaf.removesuffix("_proj"))
            key = self.aliases.get(key, key)
            if key is None or (key == "experts" and self.experts is not None):
                continue  # a projection kept in the experts, or the experts (LoRA on them: lora_on_experts)
            if key == "experts":
                raise ValueError(f"target 'experts': {self.name} has no MoE experts")
            if key not in self.projections:
                raise ValueError(f"unknown target module {t!r} for {self.name}; choose from {', '.join(self.projections)}")
            out.append(key)
        return tuple(dict.fromkeys(out))

    def lora_on_experts(self, targets) -> bool:
        """Whether the targets name the experts ("experts"): LoRA on every expert's gate|up and down,
        PEFT's target_parameters. Off unless asked: at r 32 it is ~1.3B parameters on Qwen3-30B-A3B."""
        return self.experts is not None and any(t.split(".")[-1] == "experts" for t in targets)

    def windows(self, config) -> list[int | None]:
        """Each layer's sliding window (keys (q - w, q] are seen) or None (full causal)."""
        n = config.num_hidden_layers
        w = getattr(config, "sliding_window", None)
        if not w:
            return [None] * n
        if self.windows_from == "every_layer":
            return [int(w)] * n
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        return [int(w) if t == "sliding_attention" else None for t in types]

    def layer_types(self, config) -> list[str | None]:
        """The rotary table key of each layer (None: the model's one table)."""
        n = config.num_hidden_layers
        return list(config.layer_types) if self.rope_per_layer_type else [None] * n


def attention_only_moe(name: str, model_types: tuple[str, ...], causal_lm: str, decoder_layer: str, experts: Experts,
                       **kw) -> Family:
    """A family whose every MLP is a routed MoE: the projections are attention's (q, k, v fused, o), the
    experts are 4-bit QuantExperts, LoRA goes on attention (on the experts only when "experts" is targeted),
    and the MLP's target names of dense families (gate, up, down) mean the experts' own, not a linear."""
    return Family(name, model_types, causal_lm, decoder_layer,
                  projections={k: v for k, v in LLAMA_PROJECTIONS.items() if k in ("q", "k", "v", "o")},
                  gate_up=(), fused_groups=(QKV,), aliases={"gate": None, "up": None, "down": None},
                  experts=experts, **kw)


def families() -> tuple[Family, ...]:
    from .families import FAMILIES

    return FAMILIES


def llama_norm_classes() -> tuple[str, ...]:
    """The RMSNorm classes that compute w * x_hat.to(dtype) (Family.llama_norm), which the decode glue
    restates as a fused norm; every other family's norm runs as its own module (under AQN, as
    rollout/forward.py's `noisy_norm`)."""
    return tuple(f.norm_class for f in families() if f.llama_norm)


def supported_architectures() -> tuple[str, ...]:
    return tuple(f.causal_lm for f in families())


def _by_model_type(model_type) -> Family | None:
    return next((f for f in families() if model_type in f.model_types), None)


def _supported_text() -> str:
    return ", ".join(f"{f.causal_lm} ({'/'.join(f.model_types)})" for f in families())


def family_of_config(config, source: str) -> Family:
    """The family of a config: its model_type decides (it is what transformers builds), and an
    architectures label naming another class is refused (a Llama label on a Granite config would
    otherwise load and sample wrong tokens)."""
    mt = getattr(config, "model_type", None)
    fam = _by_model_type(mt)
    archs = list(getattr(config, "architectures", None) or [])
    if fam is None:
        raise UnsupportedModelError(f"{source}: unsupported architecture {archs or mt!r} (model_type {mt!r}); qerl "
                                    f"supports {_supported_text()}")
    if archs and fam.causal_lm not in archs:
        raise UnsupportedModelError(f"{source}: unsupported architecture {archs} on model_type {mt!r}, which "
                                    f"transformers builds as {fam.causal_lm}: the label and the model_type disagree")
    _check_config(fam, config, source)
    return fam


def _check_config(fam: Family, config, source) -> None:
    why = fam.check(config) if fam.check is not None else None
    if why:
        raise UnsupportedModelError(f"{source}: {fam.name}: {why}")


def family_of_model(model, source: str | None = None) -> Family:
    """The family of a built causal LM, checked on what was built: its class, each decoder layer's
    class and its config's model_type. Anything else is refused (the engine restates the layers it
    knows; another family's layer would run the wrong arithmetic without a word)."""
    src = source or type(model).__name__
    cls = type(model).__name__
    fam = next((f for f in families() if f.causal_lm == cls), None)
    if fam is None:
        raise UnsupportedModelError(f"{src}: the model class {cls} is not one qerl runs; qerl supports "
                                    f"{_supported_text()}")
    mt = getattr(model.config, "model_type", None)
    if mt not in fam.model_types:
        raise UnsupportedModelError(f"{src}: a {cls} with config model_type {mt!r}; {fam.name} expects "
                                    f"{'/'.join(fam.model_types)}")
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"{src}: {cls} has no model.layers")
    for i, layer in enumerate(layers):
        if type(layer).__name__ != fam.decoder_layer:
            raise UnsupportedModelError(f"{src}: model.layers.{i} is a {type(layer).__name__}; {fam.name} layers are "
                                        f"{fam.decoder_layer}")
    _check_config(fam, model.config, src)
    return fam
