"""What TRL's trainers take as data and model: rows (a datasets.Dataset, any iterable of rows, or a
.jsonl path) and a model (a hub id, a folder, or a transformers model saved to a temporary folder, removed
once the trainer has loaded it: `temporary_models`)."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import tempfile
from pathlib import Path

_MADE: list[list[Path]] = []  # the temporary model folders of each trainer being built (temporary_models)


@contextlib.contextmanager
def temporary_models():
    """Around a trainer's construction: the temporary folders model_folder makes in it (a transformers model
    saved for qerl to quantize, ~15 GB for a 7B model; a folder of links with a processing_class) are removed
    when it ends, built, failed or interrupted (Ctrl-C). The trainer has loaded the policy and tokenizer from
    them by then, and names the model the script gave (base_id), never the temporary folder."""
    made: list[Path] = []
    _MADE.append(made)
    try:
        yield made
    finally:
        _MADE.remove(made)
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def removes_temporary_models(init):
    """A trainer's __init__ run inside temporary_models (its signature kept)."""
    @functools.wraps(init)
    def built(self, *args, **kw):
        with temporary_models():
            init(self, *args, **kw)
    return built


def _temporary_folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="qerl_trl_model_"))
    if _MADE:
        _MADE[-1].append(folder)
    return folder


def read_rows(data, what: str, need: str | None = "prompt") -> list | None:
    if data is None:
        return None
    if isinstance(data, (str, Path)):
        path = Path(data)
        if path.suffix != ".jsonl" or not path.is_file():
            raise ValueError(f"{what}: {data} is not a .jsonl file (pass rows, a datasets.Dataset or a .jsonl path)")
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [dict(r) for r in data]
    for i, r in enumerate(rows[:1]):
        if need is not None and need not in r:
            raise ValueError(f"{what}: row {i} has no {need!r} column (columns: {sorted(r)})")
    return rows


TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json"}


def eval_sets(data, need: str | None = "prompt") -> dict | None:
    """TRL's eval_dataset: one set ({None: rows}) or a dict of named sets ({name: rows})."""
    if data is None:
        return None
    if isinstance(data, dict) and not ({"prompt", "text", "messages"} & set(data)):  # a mapping of sets
        return {name: read_rows(d, f"eval_dataset[{name!r}]", need) for name, d in data.items()}
    return {None: read_rows(data, "eval_dataset", need)}


def model_folder(model, processing_class) -> str:
    """A hub id or folder as is; with a processing_class, a folder of links to the model's files and that
    tokenizer (TRL tokenizes with the processing_class it is given, not the checkpoint's); a transformers
    model (and its tokenizer) saved to a temporary folder, which qerl quantizes like any checkpoint (inside
    `temporary_models`, removed when the trainer is built)."""
    if isinstance(model, (str, Path)):
        from ..model.resolve import check_reachable, resolve_model

        check_reachable(str(model))  # a hub id that cannot be reached: one message naming the offline choices
        if processing_class is None or (Path(model) / "adapter_config.json").is_file():
            return str(model)

        source = resolve_model(str(model))
        folder = _temporary_folder()
        for f in source.iterdir():
            if f.name not in TOKENIZER_FILES:
                (folder / f.name).symlink_to(f.resolve())
        processing_class.save_pretrained(folder)
        return str(folder)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model: {type(model).__name__} is neither a hub id, a folder nor a transformers model")
    folder = _temporary_folder()
    model.save_pretrained(folder, safe_serialization=True)
    tok = processing_class
    if tok is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model.name_or_path)
    tok.save_pretrained(folder)
    return str(folder)


def base_id(model) -> str | None:
    """The name the adapter records as its base: the hub id or folder given, or the model object's."""
    if isinstance(model, (str, Path)):
        return None if (Path(model) / "adapter_config.json").is_file() else str(model)  # an adapter: its base
    return getattr(model, "name_or_path", None) or None
