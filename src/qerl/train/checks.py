"""Range checks of configuration fields: each bad value is a ValueError naming its field.

TrainConfig.validate runs them on the fields GRPO and SFT share (issue 48: SFT skipped them, and
save_total_limit=-1 deleted each checkpoint as it was written); a subclass runs them on its own fields.
"""

from __future__ import annotations

import math
import re

QUANTS = ("nvfp4", "mxfp4", "nf4", "bf16", "auto")
DTYPES = ("auto", "bfloat16", "float16", "float32")
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULERS = ("constant", "linear", "cosine")
OPTIMIZERS = ("adamw_8bit", "adamw_torch")
DDP_BACKENDS = (None, "nccl", "gloo")
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
MAX_SEED = 2**32 - 1  # numpy's and the engine's generators take 32-bit seeds; larger ones overflow


def bad(name: str, msg: str):
    raise ValueError(f"config field '{name}': {msg}")


def finite(cfg, name, lo=None, hi=None, lo_open=False, hi_open=False, null=False) -> None:
    """cfg.<name> is a finite number in the range (None too where `null`)."""
    v = getattr(cfg, name)
    if v is None and null:
        return
    lo_ok = lo is None or (v > lo if lo_open else v >= lo)
    hi_ok = hi is None or (v < hi if hi_open else v <= hi)
    if v is None or not math.isfinite(v) or not lo_ok or not hi_ok:
        rng = (("(" if lo_open else "[") + ("-inf" if lo is None else f"{lo:g}") + ", "
               + ("inf" if hi is None else f"{hi:g}") + (")" if hi_open or hi is None else "]"))
        bad(name, f"must be a finite number in {rng}" + (" or null" if null else "") + f", got {v!r}")


def at_least(cfg, name, lo: int, null: bool = False) -> None:
    """cfg.<name> is an integer >= lo (None too where `null`)."""
    v = getattr(cfg, name)
    if v is None and null:
        return
    if v is None or v < lo:
        bad(name, f"must be >= {lo}" + (" (or null)" if null else "") + f", got {v!r}")


def one_of(cfg, name, choices: tuple) -> None:
    v = getattr(cfg, name)
    if v not in choices:
        bad(name, f"{v!r} is not one of {', '.join('null' if c is None else str(c) for c in choices)}")


def shared(cfg) -> None:
    """Every check of a field TrainConfig declares (train/config.py), but max_steps (its subclass's)."""
    # model
    if not str(cfg.model_name_or_path).strip():
        bad("model_name_or_path", "is empty: name a folder, a hub id or 'smollm2'")
    one_of(cfg, "quant", QUANTS)
    at_least(cfg, "lora_r", 1)
    finite(cfg, "lora_alpha", 0, lo_open=True)
    finite(cfg, "lora_dropout", 0, 1, hi_open=True)
    if not cfg.lora_target_modules:
        bad("lora_target_modules", "is empty: no layer would get LoRA and nothing would train (e.g. [q, k, v, o, "
            "gate, up, down])")
    one_of(cfg, "dtype", DTYPES)
    if not DEVICE.fullmatch(cfg.device):
        bad("device", f"{cfg.device!r} is not auto, cpu, cuda or cuda:N")
    one_of(cfg, "lora_dtype", LORA_DTYPES)
    for p in cfg.modules_to_not_convert or []:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                bad("modules_to_not_convert", f"{p!r} is not a regular expression ({e})")
    # optimisation
    finite(cfg, "learning_rate", 0, 1, lo_open=True)
    one_of(cfg, "lr_scheduler_type", SCHEDULERS)
    at_least(cfg, "warmup_steps", 0)
    finite(cfg, "weight_decay", 0)
    finite(cfg, "adam_beta1", 0, 1, hi_open=True)
    finite(cfg, "adam_beta2", 0, 1, hi_open=True)
    finite(cfg, "adam_epsilon", 0, lo_open=True)
    finite(cfg, "max_grad_norm", 0)
    one_of(cfg, "optim", OPTIMIZERS)
    at_least(cfg, "per_device_train_batch_size", 1)
    at_least(cfg, "gradient_accumulation_steps", 1)
    at_least(cfg, "logprob_chunk_size", 1, null=True)
    if not 0 <= cfg.seed <= MAX_SEED:
        bad("seed", f"must be in [0, {MAX_SEED}] (2**32 - 1), got {cfg.seed!r}")
    # run
    if not str(cfg.output_dir).strip():
        bad("output_dir", "is empty: name the run's folder")
    name = cfg.run_name
    if name is not None and (not str(name).strip() or any(ord(c) < 32 for c in str(name))):
        # the trackers show it as one name (wandb's and mlflow's run lists, TensorBoard's folder)
        bad("run_name", f"must be one non-empty line without control characters, or null (the output folder's "
            f"name), got {name!r}")
    at_least(cfg, "logging_steps", 0)  # 0: no printed lines (metrics.jsonl has every step)
    at_least(cfg, "save_steps", 1)
    if cfg.save_total_limit is not None and cfg.save_total_limit < 1:
        bad("save_total_limit", f"must be >= 1 (checkpoints kept) or null (all), got {cfg.save_total_limit!r}; 0 or "
            "less would delete every checkpoint as it is written")
    # ranks
    at_least(cfg, "ddp_timeout", 1)
    one_of(cfg, "ddp_backend", DDP_BACKENDS)
