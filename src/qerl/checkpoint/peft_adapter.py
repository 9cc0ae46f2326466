"""LoRA adapters in PEFT's own format: adapter_config.json + adapter_model.safetensors.

A QLoRALinear's `lora_A`/`lora_B` have PEFT's shapes, so the adapter maps 1:1 onto
PEFT's files: tensor `base_model.model.<module path>.lora_{A,B}.weight`, no adapter
name in the key. What we write loads with `PeftModel.from_pretrained` on the dense
base, and what PEFT writes (plain LoRA, safetensors) loads here.

Nothing is ever pickled or unpickled: `adapter_model.bin` files are refused.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from ..layers import QLoRALinear
from ..layers.qlora_linear import standalone
from .safetensors_reader import CheckpointError
from .atomic import atomic_folder, entries, write_safetensors

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# what PEFT's config has no field for: the base's format and the folder it was read from, the linears kept in
# bf16, and the 4-bit head / embedding the policy computed with (lm_head_4bit, embed_4bit, compute_dtype)
INFO_NAME = "qerl_adapter.json"
HUB_IDS = dict.fromkeys(("smollm2", "smollm2-135m-instruct"), "HuggingFaceTB/SmolLM2-135M-Instruct")
PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<which>lora_A|lora_B)\.weight$")


class AdapterError(CheckpointError):
    """A PEFT adapter folder that cannot be read or does not fit the model."""


def _split(policy_or_model):
    """(model, policy or None) from a Policy or a bare model."""
    if hasattr(policy_or_model, "model") and isinstance(getattr(policy_or_model, "model"), nn.Module) and not isinstance(
        policy_or_model, nn.Module
    ):
        return policy_or_model.model, policy_or_model
    return policy_or_model, None


def _lora_layers(model: nn.Module) -> dict[str, QLoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QLoRALinear) and m.r}


def _dropout_p(layer: QLoRALinear) -> float:
    return float(layer.lora_dropout.p) if isinstance(layer.lora_dropout, nn.Dropout) else 0.0


def _uniform(values: dict[str, object], what: str):
    distinct = set(values.values())
    if len(distinct) != 1:
        sample = dict(list(values.items())[:4])
        raise ValueError(f"save_adapter: the LoRA layers differ in {what} ({sample} ...); PEFT's plain config needs one value")
    return next(iter(distinct))


def _target_modules(model: nn.Module, names: list[str]) -> list[str] | str:
    """PEFT target_modules that select exactly `names`: suffixes when they do, else a full-match regex."""
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in names})
    linears = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, QLoRALinear))]
    selected = {n for n in linears if any(n == s or n.endswith("." + s) for s in suffixes)}
    if selected == set(names):
        return suffixes
    return "^(?:" + "|".join(re.escape(n) for n in sorted(names)) + ")$"


def peft_base_name(name: str | None) -> str | None:
    """A base_model_name_or_path PEFT can load anywhere: qerl's offline alias becomes its hub id (the
    model the offline GGUF was made from); a local folder becomes absolute; hub ids pass through. The
    folder the base was really loaded from is kept beside the adapter (`base_local`, qerl_adapter.json)."""
    if name is None:
        return None
    if name.lower() in HUB_IDS:
        return HUB_IDS[name.lower()]
    local = Path(name).expanduser()
    return str(local.resolve()) if local.is_dir() else name  # absolute: PEFT reads it from any folder


def recorded_base_local(adapter_dir) -> Path | None:
    """The local folder the adapter's base was loaded from when it was trained (the offline model's
    converted copy, exactly the weights it saw), if recorded and still there; else None."""
    info = _read_info(adapter_dir)
    p = info.get("base_local")
    return Path(p) if isinstance(p, str) and (Path(p) / "config.json").is_file() else None


def _read_info(adapter_dir) -> dict:
    try:
        info = json.loads((Path(adapter_dir) / INFO_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _base_quant(layers: dict[str, QLoRALinear], kept: tuple[str, ...] = ()) -> str | None:
    """The base's format: the one of every LoRA layer, those kept in bf16 by choice (`kept` patterns) aside."""
    names = {m.fmt.name for m in layers.values()}
    if kept and len(names) > 1:
        names.discard("bf16")
    return names.pop() if len(names) == 1 else None


def recorded_modules_to_not_convert(adapter_dir) -> list[str]:
    """The linears the adapter's base kept in bf16 when it was trained (qerl_adapter.json; [] if none), which
    a load under it keeps in bf16 again: export and evaluation merge those layers from their bf16 weights."""
    kept = _read_info(adapter_dir).get("modules_to_not_convert")
    return [p for p in kept if isinstance(p, str)] if isinstance(kept, list) else []


FOUR_BIT_KEYS = ("lm_head_4bit", "embed_4bit")


def _four_bit_info(model: nn.Module) -> dict:
    """What the model computes with that PEFT's files cannot say: lm_head_4bit (a QuantHead at model.lm_head),
    embed_4bit (a QuantEmbedding as its input embedding) and compute_dtype, the dtype their 4-bit copies were
    quantized from (NVFP4's scales round in it: other bytes from fp32 weights than from bf16 ones). {} when
    neither is 4-bit: nothing is written, as in files from before these keys (absent: False)."""
    from ..layers.quant_embed import QuantEmbedding
    from ..layers.quant_head import QuantHead

    try:
        emb = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        emb = None
    head = getattr(model, "lm_head", None)
    dtypes = []
    info = {}
    if isinstance(head, QuantHead):
        info["lm_head_4bit"] = True
        dtypes.append(head.layer.dtype)  # QuantHead.from_linear: its layer computes in the weight's dtype
    if isinstance(emb, QuantEmbedding):
        info["embed_4bit"] = True
        dtypes.append(emb.dtype)  # the table's dtype when it was quantized (model.to moves it along)
    if dtypes:
        # one dtype: both are quantized from the model's compute dtype; should they differ, the embedding's
        # (a head read packed from a compressed-tensors base is kept as it is, never quantized again)
        info["compute_dtype"] = str(dtypes[-1]).removeprefix("torch.")
    return info


def recorded_4bit_options(adapter_dir) -> dict | None:
    """{lm_head_4bit, embed_4bit, dtype} that `save_adapter` recorded beside the adapter (qerl_adapter.json);
    None when it records neither option (a file from before these keys, PEFT's own, or a policy without them:
    absent keys mean False). dtype: the torch dtype the 4-bit copies were quantized from, None if not recorded."""
    info = _read_info(adapter_dir)
    opts = {k: info.get(k) is True for k in FOUR_BIT_KEYS}
    if not any(opts.values()):
        return None
    dt = info.get("compute_dtype")
    dt = getattr(torch, dt, None) if isinstance(dt, str) else None
    return {**opts, "dtype": dt if isinstance(dt, torch.dtype) and dt.is_floating_point else None}


def recorded_base_quant(adapter_dir) -> str | None:
    """The base format `save_adapter` recorded next to the adapter (None: not recorded, e.g. PEFT's own)."""
    q = _read_info(adapter_dir).get("base_quant")
    return q if isinstance(q, str) else None


def resolve_quant(adapter_dir, quant: str | None, flag: str = "--quant") -> str:
    """The base format to load under an adapter: the adapter's recorded one when `quant` is None or
    auto; an explicit other format is refused (the adapter was fitted to that base's rounding)."""
    recorded = recorded_base_quant(adapter_dir) if adapter_dir else None
    if quant in (None, "auto"):
        return recorded or "auto"
    if recorded and quant != recorded:
        raise ValueError(f"{flag} {quant}: the adapter {adapter_dir} was trained on a {recorded} base "
                         f"({Path(adapter_dir) / INFO_NAME}); its LoRA corrects that base's rounding, not {quant}'s: "
                         f"use {flag} {recorded} (or auto)")
    return quant


def save_adapter(policy_or_model, out_dir: str | os.PathLike, base_model_name_or_path: str | None = None,
                 checksums: bool = False, modules_to_not_convert=None) -> Path:
    """Write the model's LoRA factors as a PEFT adapter folder; returns the folder.

    The folder is written as a whole and swapped in (checkpoint/atomic.py): a failed save leaves
    the previous adapter intact; other files already in `out_dir` are kept. checksums: also write
    checksums.json (a run's final adapter), which load_adapter verifies. modules_to_not_convert: the
    patterns of the linears the base kept in bf16 (None: a policy's own), recorded for the loads under it.
    A 4-bit head or input embedding in the model (lm_head_4bit / embed_4bit) is recorded too, with the dtype
    it was quantized from, so the folder exports as trained wherever it is copied (qerl export).
    """
    model, policy = _split(policy_or_model)
    layers = _lora_layers(model)
    if not layers:
        raise ValueError("save_adapter: the model has no LoRA layers (was it loaded with lora_rank=0?)")
    r = _uniform({n: m.r for n, m in layers.items()}, "rank r")
    alpha = _uniform({n: float(m.lora_alpha) for n, m in layers.items()}, "lora_alpha")
    dropout = _uniform({n: _dropout_p(m) for n, m in layers.items()}, "lora_dropout")
    scaling = _uniform({n: float(m.scaling) for n, m in layers.items()}, "scaling")
    if math.isclose(scaling, alpha / r, rel_tol=1e-6):
        use_rslora = False
    elif math.isclose(scaling, alpha / math.sqrt(r), rel_tol=1e-6):
        use_rslora = True
    else:
        raise ValueError(f"save_adapter: scaling {scaling} is neither lora_alpha/r ({alpha / r}) nor "
                         f"lora_alpha/sqrt(r) (rsLoRA, {alpha / math.sqrt(r)}); PEFT cannot express it")
    src = getattr(policy, "source", None) if policy is not None else None
    src = src or getattr(getattr(model, "config", None), "_name_or_path", None)  # a bare model: its config's
    if base_model_name_or_path is None:
        base_model_name_or_path = str(src) if src else None
    base_model_name_or_path = peft_base_name(base_model_name_or_path)
    # where the base was loaded from, when the config names it otherwise (the offline model: its hub id)
    base_local = str(Path(src).resolve()) if src and Path(src).is_dir() else None
    base_local = base_local if base_local != base_model_name_or_path else None

    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "r": r,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout,
        "target_modules": _target_modules(model, list(layers)),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": use_rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }
    tensors = {}
    for name, m in layers.items():
        # standalone: a fused group's member views A_cat/B_cat; the file holds just its rows
        tensors[f"{PREFIX}{name}.lora_A.weight"] = standalone(m.lora_A.weight)
        tensors[f"{PREFIX}{name}.lora_B.weight"] = standalone(m.lora_B.weight)
    from . import expert_lora  # LoRA on MoE experts: PEFT's target_parameters

    experts = expert_lora.lora_experts(model)
    if experts:
        _uniform({**{n: m.r for n, m in layers.items()}, **{n: q.r for n, q in experts.items()}}, "rank r")
        _uniform({**{n: float(m.scaling) for n, m in layers.items()},
                  **{n: q.scaling for n, q in experts.items()}}, "scaling")
        tensors.update(expert_lora.peft_tensors(model))
        config["target_parameters"] = expert_lora.target_parameters(model)

    with atomic_folder(out_dir, keep_existing=True) as tmp:
        write_safetensors(tmp / WEIGHTS_NAME, entries(tensors))
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        kept = tuple(modules_to_not_convert if modules_to_not_convert is not None
                     else getattr(policy, "modules_to_not_convert", None) or ())
        info = {k: v for k, v in (("base_quant", _base_quant(layers, kept)), ("base_local", base_local),
                                  ("modules_to_not_convert", list(kept))) if v}
        info.update(_four_bit_info(model))  # lm_head_4bit / embed_4bit: export applies them from here
        if info:
            (tmp / INFO_NAME).write_text(json.dumps(info) + "\n")
        if checksums:
            from .checksums import write_checksums

            write_checksums(tmp)
    return Path(out_dir)


# ---- loading -----------------------------------------------------------------------------


MAX_SCALING = 1e4  # no trained adapter comes near it (PEFT's defaults: 1 to 2)


def read_adapter_config(folder: Path) -> dict:
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise AdapterError(f"{folder}: no {CONFIG_NAME} (not a PEFT adapter folder)")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path}: expected a JSON object")

    def bad(msg):
        return AdapterError(f"{path}: {msg}")

    peft_type = str(cfg.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise bad(f"peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    r = cfg.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise bad(f"r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise bad(f"lora_alpha must be a number, got {alpha!r}")
    # scaling = alpha / r multiplies every LoRA output: past this the activations overflow to inf/NaN
    if not math.isfinite(alpha) or abs(alpha) / r > MAX_SCALING:
        raise bad(f"lora_alpha {alpha!r} with r={r} gives scaling {abs(alpha) / r:.3g}; a usable adapter has "
                  f"|lora_alpha / r| <= {MAX_SCALING:g}")
    for key, ok, why in [
        ("use_dora", False, "DoRA adapters (use_dora=true) are not supported"),
        ("fan_in_fan_out", False, "fan_in_fan_out=true (GPT-2 Conv1D layout) is not supported"),
        ("lora_bias", False, "LoRA bias terms (lora_bias=true) are not supported"),
        ("use_qalora", False, "QA-LoRA adapters (use_qalora=true) are not supported"),
    ]:
        if bool(cfg.get(key, ok)) != ok:
            raise bad(why)
    if cfg.get("bias", "none") != "none":
        raise bad(f"bias={cfg['bias']!r} is not supported (only 'none': base biases stay frozen)")
    if cfg.get("modules_to_save"):
        raise bad(f"modules_to_save {cfg['modules_to_save']} is not supported (only LoRA factors are loaded)")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise bad("per-module rank_pattern / alpha_pattern is not supported (all layers must share r and lora_alpha)")
    tp = cfg.get("target_parameters")
    if tp and not (isinstance(tp, list) and all(isinstance(t, str) and t.endswith(("experts.gate_up_proj",
                                                                                    "experts.down_proj")) for t in tp)):
        raise bad(f"target_parameters {tp!r}: qerl reads LoRA on MoE experts' gate_up_proj / down_proj only")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise bad(f"use_rslora must be true or false, got {rslora!r}")
    return cfg


def _read_tensors(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = folder / WEIGHTS_NAME
    if not path.is_file():
        pickles = [n for n in PICKLE_NAMES if (folder / n).exists()]
        if pickles:
            raise AdapterError(f"{folder / pickles[0]}: pickled adapters are not loaded (unpickling can run arbitrary code); "
                               f"convert it to {WEIGHTS_NAME} (e.g. PeftModel.save_pretrained(..., safe_serialization=True))")
        raise AdapterError(f"{folder}: no {WEIGHTS_NAME}")
    try:
        f = safe_open(str(path), framework="pt")
        keys = list(f.keys())
    except Exception as e:  # safetensors raises its own error types on bad / truncated headers
        raise AdapterError(f"{path}: not a readable safetensors file, corrupt or truncated ({e})") from e
    out = {}
    for k in keys:
        try:
            out[k] = f.get_tensor(k)
        except Exception as e:
            raise AdapterError(f"{path}: cannot read tensor {k!r}, the file is corrupt or truncated ({e})") from e
    return path, out


def _matches_targets(cfg: dict, name: str) -> bool:
    """PEFT's rule for which modules a config targets (list: name or .suffix; str: full regex)."""
    t = cfg.get("target_modules")
    if t is None:
        return False
    if isinstance(t, str):
        if t == "all-linear":
            return name != "lm_head" and not name.startswith("lm_head.")  # a 4-bit head: lm_head.layer
        return re.fullmatch(t, name) is not None
    return name in t or any(name.endswith("." + s) for s in t)


def load_adapter(model_or_policy, adapter_dir: str | os.PathLike, strict: bool = True):
    """Load a PEFT LoRA adapter folder into the model's QLoRALinear layers; returns the model.

    Every tensor must name a QLoRALinear (`base_model.model.<module>.lora_{A,B}.weight`)
    and have the shape r, in_features and out_features give. Layers without LoRA, or
    with another rank, get LoRA added with the adapter's r, lora_alpha and lora_dropout;
    layers with the same rank take the adapter's lora_alpha (their dropout stays).
    use_rslora sets scaling = lora_alpha/sqrt(r). Nothing changes unless all checks pass.

    strict=True (default): an adapter tensor for a module the model lacks, a layer the
    config targets or that already has LoRA but that the file does not cover, are
    errors. strict=False skips them with a warning. Shape mismatches always fail.
    """
    model, policy = _split(model_or_policy)
    folder = Path(adapter_dir)
    if not folder.is_dir():
        raise AdapterError(f"{folder}: adapter folder not found")
    cfg = read_adapter_config(folder)
    cfg_path = folder / CONFIG_NAME
    from .checksums import ChecksumError, verify_checksums

    try:  # bytes changed since the save (an adapter written with checksums.json)
        verify_checksums(folder)
    except ChecksumError as e:
        raise AdapterError(str(e)) from None
    path, tensors = _read_tensors(folder)
    r = cfg["r"]
    alpha = float(cfg.get("lora_alpha", 8))
    dropout = float(cfg.get("lora_dropout", 0.0) or 0.0)
    rslora = bool(cfg.get("use_rslora", False))

    from . import expert_lora

    tensors, experts = expert_lora.split_peft_tensors(model, tensors)
    if experts and not cfg.get("target_parameters"):
        raise AdapterError(f"{path}: expert LoRA tensors but {cfg_path.name} has no target_parameters")
    modules = dict(model.named_modules())
    problems: list[str] = []
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            problems.append(f"{path}: tensor {key!r} is not a LoRA factor (expected "
                            f"'{PREFIX}<module>.lora_A.weight' / '.lora_B.weight')")
            continue
        mod_name, which = m["module"], m["which"]
        mod = modules.get(mod_name)
        if not isinstance(mod, QLoRALinear):
            what = "unknown module" if mod is None else f"module is a {type(mod).__name__}, not a quantized QLoRALinear"
            problems.append(f"{path}: tensor {key!r}: {what} {mod_name!r} in the model")
            continue
        pairs.setdefault(mod_name, {})[which] = t

    if problems and strict:
        raise AdapterError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    for p in problems:
        warnings.warn(p + "; skipped (strict=False)", stacklevel=2)

    # Validate every pair before touching the model.
    for mod_name, ab in pairs.items():
        layer: QLoRALinear = modules[mod_name]
        for which in ("lora_A", "lora_B"):
            key = f"{PREFIX}{mod_name}.{which}.weight"
            if which not in ab:
                raise AdapterError(f"{path}: missing tensor {key!r} (its pair "
                                   f"{'lora_B' if which == 'lora_A' else 'lora_A'} is present)")
            t = ab[which]
            want = (r, layer.in_features) if which == "lora_A" else (layer.out_features, r)
            if tuple(t.shape) != want:
                raise AdapterError(f"{path}: tensor {key!r} has shape {list(t.shape)}; module {mod_name!r} "
                                   f"(in={layer.in_features}, out={layer.out_features}) with r={r} from "
                                   f"{cfg_path.name} expects {list(want)}")
            if not t.is_floating_point():
                raise AdapterError(f"{path}: tensor {key!r} has dtype {t.dtype}, expected a floating-point type")
            if not torch.isfinite(t).all():
                raise AdapterError(f"{path}: tensor {key!r} holds non-finite values (NaN/inf)")

    required = {n for n, m in modules.items() if isinstance(m, QLoRALinear) and (m.r or _matches_targets(cfg, n))}
    if cfg.get("layers_to_transform") is not None or cfg.get("exclude_modules"):
        required = {n for n in required if modules[n].r}  # the file's keys say which layers it covers
    uncovered = sorted(required - set(pairs))
    if uncovered:
        msg = f"{path}: missing tensor {PREFIX}{uncovered[0]}.lora_A.weight" + (
            f" (and {len(uncovered) - 1} more layers)" if len(uncovered) > 1 else "")
        reasons = f"; {cfg_path.name} targets {cfg.get('target_modules')!r}"
        if strict:
            raise AdapterError(msg + reasons)
        warnings.warn(msg + reasons + "; those layers keep their current LoRA (strict=False)", stacklevel=2)
    if not pairs and not experts:
        raise AdapterError(f"{path}: no LoRA tensors for this model")
    expert_lora.load_peft_tensors(model, experts, r, alpha, alpha / math.sqrt(r) if rslora else alpha / r, path)

    regroup = {}
    with torch.no_grad():
        for mod_name, ab in pairs.items():
            layer = modules[mod_name]
            if layer.r != r:
                layer.add_lora(r, alpha, dropout)  # new parameters: its fused group must re-attach them
                if layer.group is not None:
                    regroup[id(layer.group)] = layer.group
            layer.lora_alpha = alpha
            layer.scaling = alpha / math.sqrt(r) if rslora else alpha / r
            # In place: in a fused group these parameters are views into the group's A_cat / B_cat.
            layer.lora_A.weight.copy_(ab["lora_A"].to(layer.lora_A.weight.dtype))
            layer.lora_B.weight.copy_(ab["lora_B"].to(layer.lora_B.weight.dtype))
            layer.lora_A.weight.requires_grad_(True)
            layer.lora_B.weight.requires_grad_(True)
    for group in regroup.values():
        group.attach_lora()

    if policy is not None:
        for attr, value in (("lora_rank", r), ("lora_alpha", alpha)):
            if hasattr(policy, attr):
                setattr(policy, attr, value)
    return model
