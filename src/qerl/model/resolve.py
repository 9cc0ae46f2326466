"""Turn a model name into a local folder: a path, a built-in alias, or a hub download."""

from __future__ import annotations

from pathlib import Path

# Names that need no network: the offline default model.
ALIASES = ("smollm2", "smollm2-135m-instruct")


def resolve_model(name_or_path: str | Path, revision: str | None = None) -> Path:
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p}: no config.json; not a Hugging Face model folder")
        return p
    if str(name_or_path).lower() in ALIASES:
        from .smollm2 import smollm2_path

        return smollm2_path()
    if p.exists():
        raise FileNotFoundError(f"{p}: expected a model folder, got a file")
    # A hub id: fetch configs, tokenizer and safetensors only (never pickles).
    from huggingface_hub import snapshot_download

    return Path(
        snapshot_download(
            str(name_or_path),
            revision=revision,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
        )
    )
