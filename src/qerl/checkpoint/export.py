"""export_merged: a plain dense Hugging Face folder, every quantized layer as Ŵ + scaling·B·A.

The output is what `AutoModelForCausalLM.from_pretrained` reads with no qerl, no PEFT
and no quantization_config. Tensors are produced and written one at a time, straight
into safetensors files whose headers are computed up front from the shapes, so peak
memory is the quantized model plus one dense layer. Folders above `max_shard_bytes`
are split into `model-0000i-of-0000n.safetensors` with a `model.safetensors.index.json`.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..layers import QLoRALinear

SHARD_BYTES = 4 << 30
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def _merged_weight(layer: QLoRALinear, dtype: torch.dtype) -> torch.Tensor:
    w = layer.dequantized_weight(torch.float32)
    delta = layer.lora_delta()
    if delta is not None:
        w = w + delta.to(w.device)
    return w.to(dtype)


def _entries(model: nn.Module, dtype: torch.dtype) -> list[_Entry]:
    """Every tensor of the dense model, in state-dict order, with a function that produces it."""
    owned = {n: m for n, m in model.named_modules() if isinstance(m, QLoRALinear)}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: list[_Entry] = []
    emitted: set[str] = set()

    def cast(t):
        return t.detach().to(dtype) if t.is_floating_point() else t.detach()

    for key, t in model.state_dict(keep_vars=True).items():
        mod = key.rpartition(".")[0]
        if mod in owned:
            if mod in emitted:
                continue
            emitted.add(mod)
            layer = owned[mod]
            out.append(_Entry(f"{mod}.weight", layer.weight_shape, dtype, lambda m=layer: _merged_weight(m, dtype)))
            if layer.bias is not None:
                out.append(_Entry(f"{mod}.bias", (layer.out_features,), dtype, lambda m=layer: cast(m.bias)))
            continue
        if any(key.startswith(o + ".") for o in owned):  # e.g. lora_A.weight under a QLoRALinear
            continue
        if tied and key == "lm_head.weight":
            continue  # transformers re-ties it from the embeddings
        out.append(_Entry(key, tuple(t.shape), dtype if t.is_floating_point() else t.dtype, lambda t=t: cast(t)))
    return out


def _write_safetensors(path: Path, entries: list[_Entry]) -> None:
    """A safetensors file written tensor by tensor (the header is known from the shapes)."""
    entries = sorted(entries, key=lambda e: -torch.empty((), dtype=e.dtype).element_size())  # stable: keeps alignment
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in entries:
        if e.dtype not in _ST_DTYPES:
            raise TypeError(f"export: tensor {e.name!r} has dtype {e.dtype}, which safetensors cannot hold")
        header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in entries:
            t = e.make()
            if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                raise RuntimeError(f"export: {e.name} came out {t.dtype} {list(t.shape)}, expected {e.dtype} {list(e.shape)}")
            data = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(data))
            del t, data
        f.flush()
        os.fsync(f.fileno())


def _shards(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _dense_config(model: nn.Module, dtype: torch.dtype):
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    if not getattr(cfg, "architectures", None):
        cfg.architectures = [type(model).__name__]
    cfg.dtype = dtype
    return cfg


def _copy_side_files(policy, model: nn.Module, folder: Path) -> None:
    src = Path(getattr(policy, "source", "") or "") if policy is not None else None
    if src and (src / "generation_config.json").is_file():
        shutil.copy(src / "generation_config.json", folder)
    elif getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    copied = False
    if src and src.is_dir():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy(src / name, folder)
                copied = True
    tok = getattr(policy, "tokenizer", None) if policy is not None else None
    if not copied and tok is not None:
        tok.save_pretrained(folder)


def export_merged(policy, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, *,
                  max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the policy as a dense HF model folder (dequantized base + LoRA merged); returns it.

    Accepts a Policy (its source folder gives generation_config and tokenizer files)
    or a bare model. The folder is built next to `out_dir` and moved into place at the
    end; an existing `out_dir` is replaced.
    """
    model = policy.model if hasattr(policy, "model") and not isinstance(policy, nn.Module) else policy
    policy = None if policy is model else policy
    entries = _entries(model, dtype)
    shards = _shards(entries, max_shard_bytes)

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".tmp-{out.name}-"))
    try:
        with torch.no_grad():
            if len(shards) == 1:
                _write_safetensors(tmp / "model.safetensors", shards[0])
            else:
                weight_map = {}
                for i, shard in enumerate(shards):
                    fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                    _write_safetensors(tmp / fname, shard)
                    weight_map.update({e.name: fname for e in shard})
                index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        _dense_config(model, dtype).to_json_file(str(tmp / "config.json"), use_diff=True)
        _copy_side_files(policy, model, tmp)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".old-{out.name}-"))
            os.replace(out, old / out.name)
        try:
            os.replace(tmp, out)
        except OSError:
            if old is not None:
                os.replace(old / out.name, out)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
