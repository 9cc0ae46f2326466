"""Read tensors from a model folder's safetensors files, one at a time, with clear errors.

Only safetensors: a folder that holds only pickled weights (.bin/.pt) is refused.
Every error names the file and the tensor. A float tensor holding NaN or inf is refused as it is read
(`check_finite`): every weight of a model (a projection, a norm, an embedding, a packed layer's scale)
meets the one rule, before any layer is built from it.
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
        t = t.to(device)
        check_finite(t, name, self.folder / f)
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors spells it ("BF16", "F32", "I32", "U8", "F8_E4M3", ...),
        read from the header without loading the tensor."""
        if name not in self.file_of:
            raise CheckpointError(f"{self.folder}: missing tensor {name!r}")
        return self._handles[self.file_of[name]].get_slice(name).get_dtype()


_CHUNK = 1 << 24  # elements checked at once: the mask of a 7B model's embedding would be half a GB


def check_finite(t: torch.Tensor, name: str, path) -> None:
    """Refuse a float tensor holding NaN or inf, naming the file, the tensor and the first bad index: the model
    would generate nothing and train on NaN (issue 50), a norm's NaN as silently as a projection's."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    flat = t.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK]
        part = part if part.element_size() > 1 else part.float()  # FP8: isfinite wants a wider dtype
        bad = ~torch.isfinite(part)
        if bool(bad.any()):
            from ..formats.base import NonFiniteWeightError  # a ValueError: the CLI's one line, exit status 2

            flat_index = start + int(bad.nonzero()[0, 0])
            index = [int(i) for i in torch.unravel_index(torch.tensor(flat_index), t.shape)] if t.dim() else []
            raise NonFiniteWeightError(f"{path}: {name} holds NaN or inf (first at index {index}): the checkpoint's "
                                       "weight is corrupt; qerl will not train on it (restore the file from its source)")
