"""TRL's GRPO API over qerl: a script written for TRL runs with only its import line changed,

    from trl import GRPOConfig, GRPOTrainer        ->        from qerl.trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=my_reward,
                          args=GRPOConfig(output_dir="out", learning_rate=1e-5), train_dataset=rows)
    trainer.train()

`GRPOConfig(...)` takes TRL's field names (qerl's aliases: rl/config.py FIELD_ALIASES) and TRL's
fields that steer only TRL's engines or logging (ignored, with a notice); like TRL, a config without
max_steps (or max_steps=-1) trains num_train_epochs (3.0) passes over the training prompts. Defaults
are qerl's: README.md, "Coming from TRL", lists where they differ from TRL's and why.
`GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=..., eval_dataset=..., peft_config=...)`:
model is a hub id or folder (or a transformers model, saved to a temporary folder and quantized
from there); reward_funcs one callable or a list; datasets an iterable of rows or a .jsonl path;
peft_config a peft LoraConfig or a mapping of its fields (its r, alpha, dropout and target modules,
a list of names or PEFT's regex string; a field qerl does not implement, such as use_rslora, use_dora,
modules_to_save or bias, is refused rather than dropped); args a GRPOConfig or a mapping of its fields. With conversational
prompts the reward functions receive each completion as [{"role": "assistant", "content": text}],
as TRL passes them, and every reward function that takes them gets TRL's trainer_state, log_extra and
log_metric. `callbacks` are transformers TrainerCallback objects (train/callbacks.py); `trainer.state` is
transformers' TrainerState (global_step, log_history); the step's metrics carry TRL's names beside qerl's;
`save_strategy="no"` writes no checkpoint; `report_to` takes tensorboard, wandb, trackio and mlflow.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import tempfile
from pathlib import Path

from .rl import GRPOConfig as _Config
from .rl import GRPOTrainer as _Trainer

__all__ = ["GRPOConfig", "GRPOTrainer"]

TRL_EPOCHS = 3.0  # TrainingArguments' num_train_epochs default


def GRPOConfig(**kw) -> _Config:  # noqa: N802 - TRL's class name, called as a constructor
    """qerl's GRPOConfig from TRL's keyword arguments (see the module's doc)."""
    epochs = kw.pop("num_train_epochs", TRL_EPOCHS)
    steps = kw.pop("max_steps", -1)
    cfg = _Config(**kw, **({"max_steps": steps} if steps not in (-1, None) else {}))
    cfg.trl_num_train_epochs = None if steps not in (-1, None) else float(epochs)  # read by GRPOTrainer
    return cfg


def _read_rows(data, what: str) -> list | None:
    if data is None:
        return None
    if isinstance(data, (str, Path)):
        path = Path(data)
        if path.suffix != ".jsonl" or not path.is_file():
            raise ValueError(f"{what}: {data} is not a .jsonl file (pass rows, a datasets.Dataset or a .jsonl path)")
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [dict(r) for r in data]
    for i, r in enumerate(rows[:1]):
        if "prompt" not in r:
            raise ValueError(f"{what}: row {i} has no 'prompt' column (columns: {sorted(r)})")
    return rows


def _model_folder(model, processing_class) -> str:
    """A hub id or folder as is; a transformers model (and its tokenizer) saved to a temporary folder,
    which qerl quantizes like any checkpoint."""
    if isinstance(model, (str, Path)):
        from .cli.hub import check_reachable

        check_reachable(str(model))  # a hub id that cannot be reached: one message naming the offline choices
        return str(model)
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


# LoraConfig fields qerl takes (r, alpha, dropout, targets) or that do not change training; every other
# field must be at PEFT's default, or the trainer would train something else than asked (use_rslora,
# use_dora, modules_to_save, bias... were dropped silently)
_LORA_TAKEN = {"r", "lora_alpha", "lora_dropout", "target_modules", "task_type", "peft_type", "auto_mapping",
               "peft_version", "base_model_name_or_path", "revision", "inference_mode", "runtime_config",
               "megatron_core", "qalora_group_size"}


def _lora_config(peft_config):
    """A LoraConfig (a mapping of its fields becomes one); anything else named in a ValueError."""
    if isinstance(peft_config, dict):
        try:
            from peft import LoraConfig
        except ImportError:
            raise ValueError("peft_config: a mapping needs peft installed (pip install peft)") from None
        try:
            return LoraConfig(**peft_config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"peft_config {peft_config!r}: not LoraConfig fields ({e})"[:400]) from None
    if not hasattr(peft_config, "r") or not hasattr(peft_config, "lora_alpha"):
        raise ValueError(f"peft_config: {type(peft_config).__name__} is not a peft LoraConfig (qerl trains LoRA)")
    return peft_config


def _targets(value) -> list[str] | None:
    """PEFT's target_modules as qerl's names: a list of names as is; a string is PEFT's regex, matched in
    full against each projection's module name (and its bare name); None for PEFT's all-linear default."""
    if value in (None, "all-linear"):
        return None
    if not isinstance(value, str):
        return sorted(value)
    import re

    from .model.architectures import TARGET_MODULES

    try:
        rx = re.compile(value)
    except re.error as e:
        raise ValueError(f"peft_config.target_modules {value!r}: not a regular expression ({e})") from None
    chosen, per_layer = [], set()
    for short, path in TARGET_MODULES.items():
        hits = [bool(rx.fullmatch(f"model.layers.{i}.{path}")) for i in (0, 1)]
        if len(set(hits)) > 1:
            per_layer.add(short)
        if any(hits) or rx.fullmatch(path.rpartition(".")[2]):
            chosen.append(short)
    if per_layer:
        raise ValueError(f"peft_config.target_modules {value!r} selects some layers only; qerl puts LoRA on the same "
                         f"projections of every layer (give their names, e.g. ['q_proj', 'v_proj'])")
    if not chosen:
        raise ValueError(f"peft_config.target_modules {value!r} matches none of the projections "
                         f"({', '.join(p.rpartition('.')[2] for p in TARGET_MODULES.values())})")
    return chosen


def _lora_change(peft_config) -> dict:
    """The config fields a LoraConfig sets; a field qerl would otherwise drop is refused, naming it."""
    lc = _lora_config(peft_config)
    if dataclasses.is_dataclass(lc):
        default = type(lc)()
        for f in dataclasses.fields(lc):
            if f.name in _LORA_TAKEN:
                continue
            v, d = getattr(lc, f.name), getattr(default, f.name, None)
            if v != d and not (not v and not d):
                raise ValueError(f"peft_config.{f.name}={v!r} is not supported by qerl (it would be dropped: qerl "
                                 f"trains plain LoRA on every layer's projections); leave it at {d!r}")
    change = dict(lora_r=lc.r, lora_alpha=float(lc.lora_alpha), lora_dropout=float(lc.lora_dropout))
    targets = _targets(lc.target_modules)
    if targets is not None:
        change["lora_target_modules"] = targets
    return change


class GRPOTrainer(_Trainer):
    """qerl's trainer with TRL's constructor (see the module's doc)."""

    def __init__(self, model, reward_funcs, args: _Config | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 peft_config=None, tools=None, environment_factory=None, **kw):
        if reward_processing_classes is not None or any(o is not None for o in optimizers):
            raise NotImplementedError("qerl.trl.GRPOTrainer: reward_processing_classes and optimizers are not "
                                      "supported (qerl builds its optimizer from the config: optim, learning_rate...)")
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        for f in funcs:
            if not callable(f):
                raise TypeError(f"reward_funcs: {f!r} is not callable (reward models by name are not supported; "
                                "pass a function of the completions)")
        if isinstance(args, dict):  # TRL's GRPOConfig(**args)
            try:
                args = GRPOConfig(**args)
            except TypeError as e:
                raise ValueError(f"args: {e}") from None
        elif args is not None and not isinstance(args, _Config):
            raise ValueError(f"args: {type(args).__name__} is not a GRPOConfig (pass qerl.trl.GRPOConfig(...) or a "
                             "mapping of its fields)")
        args = args if args is not None else GRPOConfig()
        epochs = getattr(args, "trl_num_train_epochs", None)
        rows = _read_rows(train_dataset, "train_dataset")
        if rows is None:
            raise ValueError("train_dataset: GRPOTrainer needs the training prompts")
        change = {"model_name_or_path": _model_folder(model, processing_class)}
        if peft_config is not None:
            change.update(_lora_change(peft_config))
        cfg = dataclasses.replace(args, **change)
        if epochs is not None:  # TRL's max_steps=-1: whole passes over the prompts
            from .rl.batching import batch_plan

            world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's, as the trainer's Dist reads it
            per_step = batch_plan(cfg, world).generation_batch_size // cfg.num_generations
            cfg = dataclasses.replace(cfg, max_steps=max(1, math.ceil(epochs * len(rows) / per_step)))
        if rows and isinstance(rows[0]["prompt"], list):
            from .rl.rewards import AsMessages

            funcs = [AsMessages(f) for f in funcs]
        super().__init__(cfg, reward_funcs=funcs, train_dataset=rows,
                         eval_dataset=_read_rows(eval_dataset, "eval_dataset"), tools=tools,
                         environment_factory=environment_factory, callbacks=callbacks, **kw)

    def save_model(self, output_dir: str | None = None) -> Path:
        """TRL's save_model: the trained LoRA adapter in PEFT's format (adapter_config.json +
        adapter_model.safetensors), loadable on the original base model."""
        from .checkpoint.peft_adapter import save_adapter

        out = Path(output_dir or self.cfg.output_dir)
        save_adapter(self.model, out, base_model_name_or_path=self.cfg.model_name_or_path)
        return out
