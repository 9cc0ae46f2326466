"""export_merged: a plain dense Hugging Face folder, every quantized layer as Ŵ + scaling·B·A.

The output is what `AutoModelForCausalLM.from_pretrained` reads with no qerl, no PEFT
and no quantization_config. Tensors are produced and written one at a time, straight
into safetensors files whose headers are computed up front from the shapes, so peak
memory is the quantized model plus one dense layer. Folders above `max_shard_bytes`
are split into `model-0000i-of-0000n.safetensors` with a `model.safetensors.index.json`.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from ..layers import QLoRALinear
from ..layers.quant_experts import QuantExperts
from .atomic import SHARD_BYTES, TensorEntry, atomic_folder, write_sharded
from .guard import OutputFolderError as ExportTargetError  # noqa: F401 - the old name, for callers
from .guard import check_output_folder

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip


def _merged_weight(layer: QLoRALinear, dtype: torch.dtype) -> torch.Tensor:
    w = layer.dequantized_weight(torch.float32)
    delta = layer.lora_delta()
    if delta is not None:
        w = w + delta.to(w.device)
    return w.to(dtype)


def _entries(model: nn.Module, dtype: torch.dtype) -> list[TensorEntry]:
    """Every tensor of the dense model, in state-dict order, with a function that produces it."""
    owned = {n: m for n, m in model.named_modules() if isinstance(m, QLoRALinear)}
    experts = {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}
    if experts:  # the stock checkpoint's names (Mixtral's block_sparse_moe), as transformers reads them
        from ..model.family import family_of_model

        fam = family_of_model(model)
        return [TensorEntry(fam.checkpoint_name(e.name), e.shape, e.dtype, e.make)
                for e in _entries_of(model, dtype, owned, experts)]
    return _entries_of(model, dtype, owned, experts)


def quant_heads(model: nn.Module) -> dict[str, str]:
    """{"lm_head.layer": "lm_head"}: the QLoRALinear inside each 4-bit head (lm_head_4bit, layers/quant_head.py)
    by the name checkpoints give the head. QuantHead is qerl's wrapper: transformers, vLLM and llm-compressor
    read the head under `lm_head`, so a writer naming it by the module path (lm_head.layer.weight) wrote a head
    no loader reads (transformers drew a random one in its place)."""
    from ..layers.quant_head import QuantHead

    return {f"{n}.layer": n for n, m in model.named_modules() if isinstance(m, QuantHead)}


def _entries_of(model, dtype, owned, experts) -> list[TensorEntry]:
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    heads = quant_heads(model)
    out: list[TensorEntry] = []
    emitted: set[str] = set()

    def cast(t):
        return t.detach().to(dtype) if t.is_floating_point() else t.detach()

    for key, t in model.state_dict(keep_vars=True).items():
        mod = key.rpartition(".")[0]
        mod = next((m for m in (mod, mod.rpartition(".")[0]) if m in experts), mod)  # its lora_A.<proj> too
        if mod in experts:
            if mod not in emitted:
                emitted.add(mod)
                out += _expert_entries(model, mod, experts[mod], dtype)
            continue
        if mod in owned:
            if mod in emitted:
                continue
            emitted.add(mod)
            layer, name = owned[mod], heads.get(mod, mod)  # a 4-bit head: the dequantized head the policy used
            out.append(TensorEntry(f"{name}.weight", layer.weight_shape, dtype,
                                   lambda m=layer: _merged_weight(m, dtype)))
            if layer.bias is not None:
                out.append(TensorEntry(f"{name}.bias", (layer.out_features,), dtype, lambda m=layer: cast(m.bias)))
            continue
        if any(key.startswith(o + ".") for o in owned):  # e.g. lora_A.weight under a QLoRALinear
            continue
        if tied and key == "lm_head.weight":
            continue  # transformers re-ties it from the embeddings
        out.append(TensorEntry(key, tuple(t.shape), dtype if t.is_floating_point() else t.dtype, lambda t=t: cast(t)))
    return out


def _expert_entries(model, name: str, q: QuantExperts, dtype) -> list[TensorEntry]:
    """A 4-bit experts module as the stock per-expert checkpoint layout (<name>.<e>.<gate|up|down>.weight,
    the family's names), each expert's weights dequantized with its LoRA merged; transformers 5 fuses
    them again on load."""
    from ..model.family import family_of_model

    ex = family_of_model(model).experts
    if not ex.per_expert:
        return _fused_expert_entries(name, q, dtype)
    n_i = q.shapes["gate_up_proj"][0] // 2
    out = []
    for e in range(q.num_experts):
        gu = lambda e=e: q.merged_weight("gate_up_proj", e)  # noqa: E731
        for proj, rows in ((ex.gate, slice(0, n_i)), (ex.up, slice(n_i, 2 * n_i))):
            out.append(TensorEntry(f"{name}.{e}.{proj}.weight", (n_i, q.shapes["gate_up_proj"][1]), dtype,
                                   lambda gu=gu, rows=rows: gu()[rows].to(dtype).contiguous()))
        out.append(TensorEntry(f"{name}.{e}.{ex.down}.weight", q.shapes["down_proj"], dtype,
                               lambda e=e: q.merged_weight("down_proj", e, dtype)))
    return out


def _fused_expert_entries(name: str, q: QuantExperts, dtype) -> list[TensorEntry]:
    """The fused 3-D layout transformers holds (gpt-oss: [E, K, N], transposed) and its biases, dense."""
    from ..layers.quant_experts import PROJECTIONS

    out = []
    for proj in PROJECTIONS:
        n, k = q.shapes[proj]
        shape = (q.num_experts, k, n) if q.transposed else (q.num_experts, n, k)

        def make(proj=proj):
            ws = [q.merged_weight(proj, e) for e in range(q.num_experts)]
            return torch.stack([w.t() if q.transposed else w for w in ws]).to(dtype).contiguous()
        out.append(TensorEntry(f"{name}.{proj}", shape, dtype, make))
        if q.bias(proj) is not None:
            out.append(TensorEntry(f"{name}.{proj}_bias", tuple(q.bias(proj).shape), dtype,
                                   lambda proj=proj: q.bias(proj).detach().to(dtype)))
    return out


def _dense_config(model: nn.Module, dtype: torch.dtype):
    cfg = copy.deepcopy(model.config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    if not getattr(cfg, "architectures", None):
        cfg.architectures = [type(model).__name__]
    cfg.dtype = dtype
    if quant_heads(model):  # a tied model's 4-bit head is a copy of the table, no longer the embedding itself
        cfg.tie_word_embeddings = False
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


def check_export_target(out_dir, *, overwrite: bool, protected: dict[str, str | os.PathLike | None]) -> None:
    """`qerl export`'s output folder checked by the guard every folder-writing command uses (checkpoint/guard.py)."""
    check_output_folder(out_dir, overwrite=overwrite, protected=protected, command="the export")


def export_merged(policy, out_dir: str | os.PathLike, dtype: torch.dtype = torch.bfloat16, *,
                  max_shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the policy as a dense HF model folder (dequantized base + LoRA merged); returns it.

    Accepts a Policy (its source folder gives generation_config and tokenizer files)
    or a bare model. The folder is built next to `out_dir` and swapped in at the end
    (checkpoint/atomic.py): an existing `out_dir` is replaced, or left whole if the export fails.
    """
    model = policy.model if hasattr(policy, "model") and not isinstance(policy, nn.Module) else policy
    policy = None if policy is model else policy
    entries = _entries(model, dtype)
    with atomic_folder(out_dir) as tmp:
        with torch.no_grad():
            write_sharded(tmp, entries, max_shard_bytes)
        _dense_config(model, dtype).to_json_file(str(tmp / "config.json"), use_diff=True)
        _copy_side_files(policy, model, tmp)
    return Path(out_dir)
