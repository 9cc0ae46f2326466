"""What TRL's trainers take as data and model: rows (a datasets.Dataset, any iterable of rows, or a
.jsonl path) and a model (a hub id, a folder, or a transformers model saved to a temporary folder)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


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
    model (and its tokenizer) saved to a temporary folder, which qerl quantizes like any checkpoint."""
    if isinstance(model, (str, Path)):
        from ..model.resolve import check_reachable, resolve_model

        check_reachable(str(model))  # a hub id that cannot be reached: one message naming the offline choices
        if processing_class is None or (Path(model) / "adapter_config.json").is_file():
            return str(model)

        source = resolve_model(str(model))
        folder = Path(tempfile.mkdtemp(prefix="qerl_trl_model_"))
        for f in source.iterdir():
            if f.name not in TOKENIZER_FILES:
                (folder / f.name).symlink_to(f.resolve())
        processing_class.save_pretrained(folder)
        return str(folder)
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model: {type(model).__name__} is neither a hub id, a folder nor a transformers model")
    folder = Path(tempfile.mkdtemp(prefix="qerl_trl_model_"))
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
