"""A tool: a Python callable plus the JSON schema a chat template's `tools=` argument renders.

The schema is transformers' own (`get_json_schema`: type hints + a Google-style docstring), so a
tool offered to a model looks exactly as it would through transformers or TRL.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


@dataclass
class Tool:
    func: Callable
    name: str = ""
    description: str = ""
    parameters: dict = field(default_factory=dict)  # a JSON schema of type "object"
    returns: dict | None = None  # transformers writes the return type hint as "return"

    @classmethod
    def from_callable(cls, func: Callable, name: str | None = None, description: str | None = None) -> Tool:
        from transformers.utils import get_json_schema

        try:
            fn = get_json_schema(func)["function"]
        except Exception as e:  # transformers raises its own DocstringParsingException / TypeError
            raise ValueError(f"tool {getattr(func, '__name__', func)!r}: no JSON schema from its signature and "
                             f"docstring ({e}); give every argument a type hint and an 'Args:' line") from None
        return cls(func, name or fn["name"], description or fn.get("description", ""), fn["parameters"],
                   fn.get("return"))

    @property
    def schema(self) -> dict:
        """The OpenAI / transformers function-calling form: what `apply_chat_template(tools=[...])` takes."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        if self.returns is not None:
            fn["return"] = self.returns
        return {"type": "function", "function": fn}

    def check_arguments(self, arguments: dict) -> str | None:
        """None when `arguments` fit the signature and the schema's types, else what is wrong (for the model)."""
        try:
            inspect.signature(self.func).bind(**arguments)
        except TypeError as e:
            return f"bad arguments for {self.name}: {e}"
        props = self.parameters.get("properties", {})
        for key, value in arguments.items():
            spec = props.get(key, {})
            types = spec.get("type")
            types = [types] if isinstance(types, str) else list(types or [])
            if spec.get("nullable"):
                types.append("null")
            if not types:
                continue
            ok = any(isinstance(value, _JSON_TYPES.get(t, object)) for t in types)
            if isinstance(value, bool) and "boolean" not in types:
                ok = False  # JSON true is not a number, though Python's bool is an int
            if not ok:
                return (f"bad arguments for {self.name}: {key!r} must be of type {' or '.join(types)}, "
                        f"got {type(value).__name__} {str(value)[:50]!r}")
            if "enum" in spec and value not in spec["enum"]:  # a Literal[...] hint
                return f"bad arguments for {self.name}: {key!r} must be one of {spec['enum']}, got {str(value)[:50]!r}"
        return None


def as_tool(obj) -> Tool:
    """A Tool as is, or a plain callable made into one."""
    if isinstance(obj, Tool):
        return obj
    if callable(obj):
        return Tool.from_callable(obj)
    raise TypeError(f"a tool must be a Tool or a callable, got {type(obj).__name__}")


def as_tools(tools) -> dict[str, Tool]:
    """name -> Tool, refusing two tools with one name (the model could not tell them apart)."""
    out: dict[str, Tool] = {}
    for t in map(as_tool, tools or []):
        if t.name in out:
            raise ValueError(f"two tools are named {t.name!r}")
        out[t.name] = t
    return out
