"""Typed configuration fields, read from files, flags and keyword arguments (GRPOConfig's and SFTConfig's).

Each field carries its help text (`qerl ... --print_config` documents every default) and is typed from
its annotation: YAML 1.1 reads 2e-5 as text and users quote numbers, so values are converted where the
meaning is exact and refused, naming the field and its source, where it is not.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import field
from pathlib import Path

import yaml


def setting(default, help: str, **kw):
    """A config field with its help text (and `choices=`, `item=` for a list's items) as metadata."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


# values TRL (or transformers) accepts for a field, as qerl's: scale_rewards true/false as TRL's __post_init__
VALUE_ALIASES = {
    "scale_rewards": {True: "group", False: "none", "true": "group", "false": "none"},
    "optim": {"adamw_torch_fused": "adamw_torch", "adamw_bnb_8bit": "adamw_8bit", "paged_adamw_8bit": "adamw_8bit"},
    "lr_scheduler_type": {"constant_with_warmup": "constant"},  # qerl's constant has its warm-up
}


def typed(cls, d: dict, source: str, convert=None):
    """cls(**d) with every value coerced to its field's type; an unknown field is an error naming `source`
    (typed here, before any model loads, so the error can name the file). GRPOConfig's and SFTConfig's."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in d:
        if k not in fields:
            near = difflib.get_close_matches(k, fields, n=1)
            raise ValueError(f"{source}: unknown field '{k}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
    convert = convert or coerce  # a config's own coercion where its fields need one (SFTConfig)
    values = {k: convert(fields[k], v, source) for k, v in d.items()}
    try:
        return cls(**values)
    except ValueError as e:  # a value the config's checks refuse: name the file it came from
        if source in ("config", "command line") or str(e).startswith(f"{source}:"):
            raise
        raise ValueError(f"{source}: {e}") from None


def yaml_mapping(path) -> dict:
    """A config file's field: value mapping; a file that is not one is an error naming it."""
    path = Path(path)
    try:
        d = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:  # PyYAML's message spans lines (a caret under a copy of the line): one line here
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        what, context, begun = (getattr(e, k, None) for k in ("problem", "context", "context_mark"))
        if context:  # "while parsing a flow sequence", where the unclosed bracket opened
            at = f" at line {begun.line + 1} column {begun.column + 1}" if begun is not None else ""
            what = f"{what}; {context}{at}" if what else f"{context}{at}"
        what = " ".join(str(what or "").split())
        raise ValueError(f"{path}{where}: not valid YAML ({what or ' '.join(str(e).split())}); fix the syntax "
                         "there (a mapping of field: value)") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a mapping of field: value, got {type(d).__name__}")
    return d


def parse_value(name: str, text: str, cls):
    """A command-line value as YAML would read it (from_dict then types it by the field)."""
    hints = typing.get_type_hints(cls)
    if name not in hints:
        near = difflib.get_close_matches(name, hints, n=1)
        raise ValueError(f"command line: unknown field '--{name}'" + (f" (did you mean '--{near[0]}'?)" if near else ""))
    if str in _types(hints[name]):
        return None if text in ("null", "~") and type(None) in _types(hints[name]) else text  # `--seed_name 007` stays text
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if list in _types(hints[name]) and isinstance(v, str):
        return [s.strip() for s in v.split(",") if s.strip()]  # --lora_target_modules q,v
    return v


# ---- typing every value by its field ----------------------------------------------------------
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")
_HINTS: dict[str, object] = {}  # a field's annotation text -> its type


def hint(f: dataclasses.Field):
    """The type a field's annotation names (annotations are text under `from __future__ import annotations`)."""
    if not isinstance(f.type, str):
        return f.type
    if f.type not in _HINTS:
        _HINTS[f.type] = eval(f.type, {})  # noqa: S307 - the config classes' own annotations (int | None, list...)
    return _HINTS[f.type]


def _types(hint) -> tuple:
    """(float,) for `float`, (float, NoneType) for `float | None`."""
    args = typing.get_args(hint)
    return args if args else (hint,)


def coerce(f: dataclasses.Field, value, source: str):
    """`value` as the type of field `f`, or a ValueError naming the field and `source` (a file or the
    command line). YAML 1.1 reads 2e-5 as a string and users quote numbers and booleans: those
    are converted; what has no exact meaning in the field's type (6.7 steps, aqn: "maybe") is an error."""
    types = _types(hint(f))
    if value is None and type(None) in types:
        return None
    label = f"--{f.name}" if source == "command line" else f"field '{f.name}'"
    want = next(t for t in types if t is not type(None))
    aliases = VALUE_ALIASES.get(f.name, {})
    if isinstance(value, (bool, str)) and value in aliases:
        value = aliases[value]
    try:
        out = _as(want, value)
        if want is list and f.metadata.get("item") is not None:
            out = [_as(f.metadata["item"], x) for x in out]
        choices = f.metadata.get("choices")
        if choices and out not in choices:
            raise ValueError(f"one of {', '.join(choices)}")
        return out
    except (TypeError, ValueError) as e:
        null = " or null" if type(None) in types else ""
        raise ValueError(f"{source}: {label}: {value!r} is not {e}{null}") from None


def _as(want: type, v):
    """v converted to `want`; raises ValueError('a <what>') when it cannot be, exactly."""
    if want is bool:
        if isinstance(v, bool):
            return v
        text = str(v).strip().lower() if isinstance(v, (str, int)) else None
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
        raise ValueError("a boolean (true/false, yes/no)")
    if want is int:
        if isinstance(v, bool):
            raise ValueError("an integer")
        if isinstance(v, int):
            return v
        x = _number(v, "an integer")
        if isinstance(x, int):
            return x
        if math.isfinite(x) and x.is_integer():
            return int(x)
        raise ValueError("an integer (a non-integral value is not rounded)")
    if want is float:
        if isinstance(v, bool):
            raise ValueError("a number")
        x = float(_number(v, "a number"))
        if math.isnan(x):
            raise ValueError("a number (NaN is not a setting)")
        return x
    if want is str:
        if isinstance(v, str):
            return v
        raise ValueError("a string (quote it in YAML)")
    if want in (list, dict):
        if isinstance(v, want):
            return want(v)
        raise ValueError(f"a {'list' if want is list else 'mapping'}")
    return v


def _number(v, what: str):
    """An int or float from a number or its text ('6', '2e-5', '1_000'); ValueError(what) otherwise."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        t = v.strip()
        for conv in (int, float):
            try:
                return conv(t)
            except ValueError:
                pass
    raise ValueError(what)
