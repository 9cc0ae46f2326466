"""A PEFT adapter folder as the model to load: its base with the adapter on it.

transformers' `from_pretrained` and TRL's `model_name_or_path` take an adapter folder (an
adapter_config.json, no config.json) as "the base named in it, plus this adapter", so `qerl train
--model_name_or_path runs/sft/adapter` continues from a `qerl sft` (or PEFT, or TRL) adapter. The
LoRA takes the adapter's rank and alpha; the base comes from base_model_name_or_path (followed
through adapter folders: an RL adapter started from an SFT adapter names that one).
"""

from __future__ import annotations

from pathlib import Path


def adapter_folder(name_or_path) -> Path | None:
    """The folder when `name_or_path` is a PEFT adapter folder (and not a model folder), else None."""
    p = Path(name_or_path).expanduser()
    return p if p.is_dir() and (p / "adapter_config.json").is_file() and not (p / "config.json").exists() else None


def base_of(name_or_path) -> str:
    """The base model an adapter folder (or a chain of them) sits on; any other name unchanged. What a
    new adapter trained from it names as its base_model_name_or_path, so PEFT can load it."""
    folder, seen = adapter_folder(name_or_path), 0
    while folder is not None and seen < 8:
        from ..checkpoint.peft_adapter import read_adapter_config

        name_or_path = read_adapter_config(folder).get("base_model_name_or_path") or str(folder)
        folder, seen = adapter_folder(name_or_path), seen + 1
    return str(name_or_path)


def base_to_load(name_or_path) -> str:
    """The folder to load an adapter folder's base from: the one it was trained on when recorded and still
    here (qerl_adapter.json's base_local: the offline model's converted copy, which its config names by hub
    id), else the base its config names (base_of). Any other name unchanged."""
    folder = adapter_folder(name_or_path)
    if folder is not None:
        from ..checkpoint.peft_adapter import recorded_base_local

        local = recorded_base_local(folder)
        if local is not None:
            return str(local)
    return base_of(name_or_path)


def load_adapter_start(folder: Path, load_policy, quant: str, **kw):
    """load_policy of the adapter's base with the adapter's rank and alpha, then the adapter loaded on it. The
    linears the adapter was trained on in bf16 (modules_to_not_convert, recorded beside it) stay bf16 unless
    others are asked for: its LoRA corrects those layers' bf16 weights, not their rounding."""
    from ..checkpoint.peft_adapter import read_adapter_config, load_adapter, recorded_modules_to_not_convert

    cfg = read_adapter_config(folder)
    base = cfg.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{folder}/adapter_config.json: no base_model_name_or_path, so the base to load it on is "
                         "unknown (load the base and pass the adapter separately)")
    seen = [folder]
    while (inner := adapter_folder(base)) is not None:
        # an adapter trained from another adapter (qerl train from `qerl sft`'s) names that one as its base: it
        # holds the whole LoRA, so the base is the first non-adapter up the chain
        if inner.resolve() in {p.resolve() for p in seen} or len(seen) > 8:
            raise ValueError(f"{folder}/adapter_config.json: base_model_name_or_path leads through adapter folders "
                             f"in a loop ({' -> '.join(map(str, seen + [inner]))})")
        seen.append(inner)
        base = read_adapter_config(inner).get("base_model_name_or_path")
        if not base:
            raise ValueError(f"{inner}/adapter_config.json: no base_model_name_or_path")
    from ..checkpoint.peft_adapter import recorded_base_local

    base = str(recorded_base_local(folder) or base)  # the exact weights it was trained on, when still here
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", 8))
    asked = (kw.get("lora_rank"), kw.get("lora_alpha"))
    if asked != (r, alpha) and kw.get("progress", True):
        print(f"qerl: {folder}: starting from the adapter (r={r}, lora_alpha={alpha:g}) on {base}; its rank and "
              f"alpha replace the requested {asked[0]} / {asked[1]}")
    if not kw.get("modules_to_not_convert"):
        kw["modules_to_not_convert"] = recorded_modules_to_not_convert(folder) or None
    policy = load_policy(base, quant, **{**kw, "lora_rank": r, "lora_alpha": alpha})
    load_adapter(policy, folder)
    return policy
