"""PEFT's LoraConfig as qerl's LoRA fields: r, alpha, dropout and the target projections (names, or
PEFT's regex string); a field qerl does not implement (use_rslora, use_dora, modules_to_save, bias...)
is refused by name rather than dropped."""

from __future__ import annotations

import dataclasses

# LoraConfig fields qerl takes (r, alpha, dropout, targets) or that do not change training; every other
# field must be at PEFT's default, or the trainer would train something else than asked (use_rslora,
# use_dora, modules_to_save, bias... were dropped silently)
_LORA_TAKEN = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "peft_type", "auto_mapping",
               "peft_version", "base_model_name_or_path", "revision", "inference_mode", "runtime_config",
               "megatron_core", "qalora_group_size"}


def _lora_config(peft_config):
    """A LoraConfig (a mapping of its fields becomes one); anything else named in a ValueError."""
    if isinstance(peft_config, dict):
        try:
            from peft import LoraConfig
        except ImportError:
            raise ValueError("peft_config: a mapping needs peft installed (pip install peft)") from None
        try:
            return LoraConfig(**peft_config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"peft_config {peft_config!r}: not LoraConfig fields ({e})"[:400]) from None
    if not hasattr(peft_config, "r") or not hasattr(peft_config, "lora_alpha"):
        raise ValueError(f"peft_config: {type(peft_config).__name__} is not a peft LoraConfig (qerl trains LoRA)")
    return peft_config


def _targets(value) -> list[str] | None:
    """PEFT's target_modules as qerl's names: a list of names as is; a string is PEFT's regex, matched in
    full against each projection's module name (and its bare name); None for PEFT's all-linear default."""
    if value in (None, "all-linear"):
        return None
    if not isinstance(value, str):
        return sorted(value)
    import re

    from ..model.architectures import TARGET_MODULES

    try:
        rx = re.compile(value)
    except re.error as e:
        raise ValueError(f"peft_config.target_modules {value!r}: not a regular expression ({e})") from None
    chosen, per_layer = [], set()
    for short, path in TARGET_MODULES.items():
        hits = [bool(rx.fullmatch(f"model.layers.{i}.{path}")) for i in (0, 1)]
        if len(set(hits)) > 1:
            per_layer.add(short)
        if any(hits) or rx.fullmatch(path.rpartition(".")[2]):
            chosen.append(short)
    if per_layer:
        raise ValueError(f"peft_config.target_modules {value!r} selects some layers only; qerl puts LoRA on the same "
                         f"projections of every layer (give their names, e.g. ['q_proj', 'v_proj'])")
    if not chosen:
        raise ValueError(f"peft_config.target_modules {value!r} matches none of the projections "
                         f"({', '.join(p.rpartition('.')[2] for p in TARGET_MODULES.values())})")
    return chosen


def lora_change(peft_config) -> dict:
    """The config fields a LoraConfig sets; a field qerl would otherwise drop is refused, naming it."""
    lc = _lora_config(peft_config)
    if dataclasses.is_dataclass(lc):
        default = type(lc)()
        for f in dataclasses.fields(lc):
            if f.name in _LORA_TAKEN:
                continue
            v, d = getattr(lc, f.name), getattr(default, f.name, None)
            if v != d and not (not v and not d):
                raise ValueError(f"peft_config.{f.name}={v!r} is not supported by qerl (it would be dropped: qerl "
                                 f"trains plain LoRA on every layer's projections); leave it at {d!r}")
    change = dict(lora_r=lc.r, lora_alpha=float(lc.lora_alpha), lora_dropout=float(lc.lora_dropout))
    targets = _targets(lc.target_modules)
    if targets is not None:
        change["lora_target_modules"] = targets
    return change
