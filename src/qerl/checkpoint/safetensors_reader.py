"""Read tensors from a model folder's safetensors files, one at a time, with clear errors.

Only safetensors: a folder that holds only pickled weights (.bin/.pt) is refused.
Every error names the file and the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    pass


class SafetensorsCheckpoint:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = None
        if not files:
            pickles = [p.name for p in self.folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
            hint = f" (found {', '.join(pickles)}: pickled weights are not read, convert them to safetensors)" if pickles else ""
            raise CheckpointError(f"{self.folder}: no .safetensors weights{hint}")
        self._handles = {}
        self.file_of: dict[str, str] = {}
        for f in files:
            path = self.folder / f
            if not path.exists():
                raise CheckpointError(f"{path}: listed in the index but missing")
            try:
                h = safe_open(str(path), framework="pt")
                keys = list(h.keys())
            except Exception as e:  # safetensors raises its own error types on bad headers
                raise CheckpointError(f"{path}: cannot read safetensors header ({e})") from e
            self._handles[f] = h
            for k in keys:
                self.file_of[k] = f
        if weight_map:
            absent = [k for k, f in weight_map.items() if self.file_of.get(k) != f]
            if absent:
                raise CheckpointError(f"{index}: tensor {absent[0]!r} is not in {weight_map[absent[0]]}")

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def keys(self):
        return self.file_of.keys()

    def path_of(self, name: str) -> Path:
        return self.folder / self.file_of[name]

    def get(self, name: str, device="cpu") -> torch.Tensor:
        if name not in self.file_of:
            raise CheckpointError(f"{self.folder}: missing tensor {name!r}")
        f = self.file_of[name]
        try:
            t = self._handles[f].get_tensor(name)
        except Exception as e:  # a truncated file fails here, on the first read past its end
            raise CheckpointError(f"{self.folder / f}: cannot read tensor {name!r} ({e})") from e
        return t.to(device)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors spells it ("BF16", "F32", "I32", "U8", "F8_E4M3", ...),
        read from the header without loading the tensor."""
        if name not in self.file_of:
            raise CheckpointError(f"{self.folder}: missing tensor {name!r}")
        return self._handles[self.file_of[name]].get_slice(name).get_dtype()
