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
    if looks_like_path(str(name_or_path)):
        raise FileNotFoundError(f"{p}: no such model folder" + _nearest_parent(p))
    # A hub id: fetch configs, tokenizer and safetensors only (never pickles).
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(
            snapshot_download(
                str(name_or_path),
                revision=revision,
                allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"],
            )
        )
    except HFValidationError as e:
        raise FileNotFoundError(f"{name_or_path}: neither a local model folder nor a valid hub id ({e})") from None
    except Exception as e:  # offline, no such repository, gated: say both places were looked in
        raise FileNotFoundError(f"{name_or_path}: no local folder {p.absolute()}, and the hub download failed "
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def looks_like_path(name: str) -> bool:
    """A hub id is `name` or `owner/name`; anything absolute, relative (./, ../, ~), with a backslash
    or more than one slash can only be a local path, so a missing one is reported as a missing folder."""
    return (name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1
            or name.endswith("/"))


def _nearest_parent(p: Path) -> str:
    for parent in p.absolute().parents:
        if parent.is_dir():
            return f" ({parent} exists, {p.absolute().relative_to(parent).parts[0]!r} is not in it)"
    return ""
