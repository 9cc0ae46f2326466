"""The one path normaliser of a run's config: every local path as the user wrote it (`~`, relative to
the working folder, a link) made absolute when the config is read, and checked before the model loads.

- `~` is expanded (a YAML `output_dir: ~/runs/x` was a folder named `~`);
- a relative path is made absolute against the working folder the config is read in, so the run
  folder's config.yaml records where the run's model and data are (a resume from another folder
  read that folder's files);
- links are kept, not resolved: the run writes through a linked output folder, and its messages name
  the path the user gave;
- a dangling link, or a name longer than the file system takes, is refused here by field and path,
  not after minutes of model loading.
Hub ids, the model aliases and task names are not paths and stay as written.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
TASK_KINDS = ("arithmetic", "reasoning_gym", "tool_arithmetic", "gsm8k-offline")  # tasks/options.kind_of's tasks


class PathError(ValueError):  # the CLI reports ValueErrors as one line, exit status 2
    pass


def expand(value: str) -> str:
    """`~` expanded and made absolute against the working folder; links kept (written through)."""
    return os.path.abspath(os.path.expanduser(value))


def is_local_model(name) -> bool:
    """model_name_or_path names a local folder (resolve_model's order: a folder first, then the aliases,
    then a hub id unless it can only be a path)."""
    from ..model.resolve import looks_like_path

    return isinstance(name, str) and bool(name) and (looks_like_path(name) or os.path.lexists(os.path.expanduser(name)))


def is_local_data(name) -> bool:
    """dataset_name names a local file (get_task's and load_rows' order: the task names first)."""
    from ..model.resolve import looks_like_path
    from ..tasks.options import kind_of

    if not isinstance(name, str) or not name:
        return False
    if Path(name).suffix.lower() in DATA_SUFFIXES:
        return True
    if kind_of(name) in TASK_KINDS:
        return False
    return looks_like_path(name) or os.path.lexists(os.path.expanduser(name))


def local_paths(cfg) -> dict[str, str]:
    """{field: path as written} of every local path `cfg` names (`dataset_config.eval_file` by that name)."""
    out = {"output_dir": cfg.output_dir}
    if is_local_model(cfg.model_name_or_path):
        out["model_name_or_path"] = cfg.model_name_or_path
    for name in ("dataset", "eval_dataset"):
        value = getattr(cfg, f"{name}_name", None)
        if is_local_data(value):
            out[f"{name}_name"] = value
        extra = getattr(cfg, f"{name}_config", None) or {}
        if isinstance(extra, dict) and isinstance(extra.get("eval_file"), str):
            out[f"{name}_config.eval_file"] = extra["eval_file"]
    return out


def check_path(field: str, path: str) -> None:
    """A dangling link (the path or a folder above it) or a name past the file system's limit: one line."""
    p = Path(expand(path))
    if os.path.lexists(p) and not p.exists():
        raise PathError(f"config field '{field}': {path} is a link to {os.path.realpath(p)}, which does not exist; "
                        "fix the link or name the target itself")
    for up in p.parents:
        if up.is_symlink() and not up.exists():
            raise PathError(f"config field '{field}': {path}: the folder {up} is a link to {os.path.realpath(up)}, "
                            "which does not exist; fix the link or name the target itself")
    top = next((q for q in p.parents if q.is_dir()), Path("/"))
    try:
        limit = os.pathconf(top, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in p.parts:
        if len(os.fsencode(part)) > limit:
            raise PathError(f"config field '{field}': {path}: the name {part[:24]}... is {len(os.fsencode(part))} "
                            f"bytes, the file system takes {limit}; choose a shorter name")


def normalise(cfg):
    """`cfg` with every local path absolute and `~` expanded, each checked (check_path). Idempotent."""
    found = local_paths(cfg)
    for field, path in found.items():
        check_path(field, path)
    changes = {}
    for field, path in found.items():
        name, _, key = field.partition(".")
        if key:  # a path inside an options mapping
            changes[name] = {**changes.get(name, getattr(cfg, name)), key: expand(path)}
        elif expand(path) != path:
            changes[name] = expand(path)
    if all(getattr(cfg, k) == v for k, v in changes.items()):
        return cfg
    new = dataclasses.replace(cfg, **changes)
    names = {f.name for f in dataclasses.fields(cfg)}
    new.__dict__.update({k: v for k, v in vars(cfg).items() if k not in names})  # what a reader attached (SFT's .trl)
    return new


def relative_paths(cfg) -> dict[str, str]:
    """The local paths `cfg` names relative to some working folder (a run folder written by an older qerl)."""
    return {k: v for k, v in local_paths(cfg).items() if not os.path.isabs(os.path.expanduser(v))}


def same_path(a, b) -> bool:
    """Two paths naming the same place, links followed."""
    return os.path.realpath(expand(str(a))) == os.path.realpath(expand(str(b)))
