"""Training checkpoints: everything a run needs to continue exactly, written atomically.

A checkpoint is a folder `checkpoint-<global_step>` (TRL's and transformers' name: optimizer steps so far;
folders written before named it by the trainer's own step, which its trainer_state.json still records as
`step`, what a resume reads) built under a temporary name and swapped into
place by checkpoint/atomic.py, so a run killed at any moment leaves either the complete folder or
none (its temporaries are undone when the run folder is next claimed). It holds:
  adapter/                PEFT adapter (loads in PEFT / vLLM on the dense base)
  trainable.safetensors   every trainable tensor, exact (LoRA, and norms when trained)
  optimizer.safetensors   optimizer state tensors; their structure in trainer_state.json
  rng.safetensors         torch CPU / CUDA generator states
  trainer_state.json      step, data position, scheduler, python RNG, config
  rollout_adapter.safetensors  (max_staleness 1) the adapter of the rollout in flight (rl/staleness.py)
Safetensors and JSON only: nothing is pickled.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint.atomic import atomic_folder
from ..checkpoint.checksums import ChecksumError, verify_checksums, write_checksums
from ..checkpoint.peft_adapter import save_adapter
from ..checkpoint.run_files import STATE_NAME, checkpoints
from ..layers.qlora_linear import standalone



def _flatten_optimizer(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, meta = {}, {"param_groups": sd["param_groups"], "state": {}}
    for idx, st in sd["state"].items():
        meta["state"][str(idx)] = {k: _flatten_entry(v, f"state.{idx}.{k}", tensors) for k, v in st.items()}
    return tensors, meta


def _flatten_entry(v, key: str, tensors: dict) -> dict:
    """One optimizer-state entry as JSON, its tensors into `tensors` under `key`. Entries nest: bitsandbytes
    (>= 0.48) keeps its 8-bit states, maps and absmax in one dict per parameter."""
    if isinstance(v, torch.Tensor):
        if key in tensors:  # keys join with '.': a nested key holding one could name another entry's tensor
            raise ValueError(f"optimizer state {key}: two entries flatten to this name")
        # a copy of its own: bitsandbytes shares one quantization map between parameters, and safetensors
        # refuses tensors that share memory
        tensors[key] = v.detach().to("cpu", copy=True).contiguous()
        return {"tensor": key}
    if isinstance(v, dict):
        return {"dict": {str(k): _flatten_entry(x, f"{key}.{k}", tensors) for k, x in v.items()}}
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        raise TypeError(f"optimizer state {key} is of type {type(v).__name__}, which a checkpoint cannot hold "
                        "(tensors, dicts and JSON values only)") from None
    return {"value": v}


def _unflatten_entry(m: dict, tensors: dict):
    if "tensor" in m:
        return tensors[m["tensor"]]
    if "dict" in m:
        return {k: _unflatten_entry(x, tensors) for k, x in m["dict"].items()}
    return m["value"]


def _tensor_keys(m: dict):
    if "tensor" in m:
        yield m["tensor"]
    for x in m.get("dict", {}).values():
        yield from _tensor_keys(x)


def _unflatten_optimizer(tensors: dict, meta: dict) -> dict:
    state = {int(idx): {k: _unflatten_entry(v, tensors) for k, v in m.items()} for idx, m in meta["state"].items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(output_dir, step: int, model, optimizer, scheduler, extra: dict, base_name: str | None = None,
                    keep: int | None = None, tensors: dict[str, dict[str, torch.Tensor]] | None = None,
                    name: int | None = None) -> Path:
    """step: the trainer's own step (trainer_state.json's `step`, what a resume restores); name: the folder's
    number, checkpoint-<name> (the loop's TRL global_step; default step); tensors: more named tensor files,
    {stem: {name: tensor}} -> stem.safetensors (read_tensors)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / f"checkpoint-{step if name is None else name}"
    with atomic_folder(final) as tmp:  # a rerun of the same step replaces it whole, or not at all
        save_adapter(model, tmp / "adapter", base_model_name_or_path=base_name)
        # standalone: LoRA factors of a fused group are views into its storage
        trainable = {n: standalone(p) for n, p in model.named_parameters() if p.requires_grad}
        save_file(trainable, tmp / "trainable.safetensors")
        opt_t, opt_meta = _flatten_optimizer(optimizer.state_dict())
        save_file(opt_t, tmp / "optimizer.safetensors")
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                rng[f"torch_cuda_{i}"] = s
        save_file(rng, tmp / "rng.safetensors")
        for stem, ts in (tensors or {}).items():
            save_file(ts, tmp / f"{stem}.safetensors")
        state = {"step": step, "optimizer": opt_meta, "scheduler": scheduler.state_dict(),
                 "python_random": _jsonable(random.getstate()), **extra}
        (tmp / STATE_NAME).write_text(json.dumps(state, indent=1))
        write_checksums(tmp)  # verified at resume: bytes changed in place fail there, not silently
    if keep:
        for old in checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tupled(x):
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x


class CorruptCheckpoint(ValueError):
    """A checkpoint file that is missing, truncated or not what qerl wrote; the message names it."""


_STATE_KEYS = ("step", "optimizer", "scheduler", "python_random", "data")
_TENSOR_FILES = ("trainable.safetensors", "optimizer.safetensors", "rng.safetensors")


def read_checkpoint(folder) -> tuple[dict, dict[str, dict]]:
    """Every file of a checkpoint read and checked, nothing applied yet: (trainer_state, {file: tensors}).
    Raises CorruptCheckpoint naming the file that fails."""
    folder = Path(folder)
    f = folder / STATE_NAME
    try:
        state = json.loads(f.read_text())
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{f}: missing (not a complete qerl checkpoint)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpoint(f"{f}: not valid JSON ({type(e).__name__}: {e})"[:400]) from None
    missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CorruptCheckpoint(f"{f}: not a qerl trainer state (no {', '.join(missing)})")
    tensors = {}
    for name in _TENSOR_FILES:
        try:
            tensors[name] = load_file(folder / name)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for truncation
            raise CorruptCheckpoint(f"{folder / name}: unreadable ({type(e).__name__}: {e})"[:400]) from None
    try:
        keys = {k for m in state["optimizer"]["state"].values() for v in m.values() for k in _tensor_keys(v)}
    except (AttributeError, KeyError, TypeError):
        raise CorruptCheckpoint(f"{f}: its optimizer section is not what qerl writes") from None
    if not keys <= set(tensors["optimizer.safetensors"]):
        raise CorruptCheckpoint(f"{folder / 'optimizer.safetensors'}: lacks tensors that {STATE_NAME} lists")
    try:  # files that parse may still hold other bytes than were saved (flipped in place)
        verify_checksums(folder)
    except ChecksumError as e:
        raise CorruptCheckpoint(str(e)) from None
    return state, tensors


def read_tensors(folder, stem: str) -> dict[str, torch.Tensor]:
    """A tensor file that save_checkpoint(tensors=...) wrote; CorruptCheckpoint names it when unreadable."""
    f = Path(folder) / f"{stem}.safetensors"
    try:
        return load_file(f)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for truncation
        raise CorruptCheckpoint(f"{f}: unreadable ({type(e).__name__}: {e})"[:400]) from None


def load_checkpoint(folder, model, optimizer, scheduler) -> dict:
    """Restore a checkpoint into live objects; returns its trainer_state (step, data position, ...).
    Every file is read and checked before anything is changed (CorruptCheckpoint names a bad file)."""
    folder = Path(folder)
    state, files = read_checkpoint(folder)
    params = dict(model.named_parameters())
    saved = files["trainable.safetensors"]
    want = {n for n, p in params.items() if p.requires_grad}
    if set(saved) != want:
        miss, extra = sorted(want - set(saved))[:3], sorted(set(saved) - want)[:3]
        raise ValueError(f"{folder}/trainable.safetensors does not match the model's trainable tensors "
                         f"(missing {miss}, unexpected {extra}): same model, lora_r and train_norms?")
    with torch.no_grad():
        for n, t in saved.items():
            if params[n].shape != t.shape:
                raise ValueError(f"{folder}/trainable.safetensors: {n} has shape {tuple(t.shape)}, "
                                 f"the model {tuple(params[n].shape)}")
            params[n].copy_(t)
    optimizer.load_state_dict(_unflatten_optimizer(files["optimizer.safetensors"], state["optimizer"]))
    scheduler.load_state_dict(state["scheduler"])
    rng = files["rng.safetensors"]
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        cuda = [rng[k] for k in sorted(k for k in rng if k.startswith("torch_cuda_"))]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    random.setstate(_tupled(state["python_random"]))
    return state
