"""Checks on the config fields that name things outside it (a device, a format, the task's options),
run by `GRPOConfig.validate` at load time, so a bad value fails before any model loads and the
error names the field (issue 22: `--lora_r -4` and `--device tpu` used to end in tracebacks)."""

from __future__ import annotations

import math
import re

QUANTS = ("nvfp4", "mxfp4", "nf4", "bf16", "auto")
DTYPES = ("auto", "bfloat16", "float16", "float32")
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_inputs(cfg) -> None:
    def bad(name, msg):
        raise ValueError(f"config field '{name}': {msg}")

    if cfg.lora_r < 1:
        bad("lora_r", f"must be >= 1 (the trained LoRA rank), got {cfg.lora_r}")
    if not math.isfinite(cfg.lora_alpha) or cfg.lora_alpha <= 0:
        bad("lora_alpha", f"must be a finite number > 0, got {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        bad("lora_dropout", f"must be in [0, 1), got {cfg.lora_dropout}")
    if not DEVICE.fullmatch(cfg.device):
        bad("device", f"{cfg.device!r} is not auto, cpu, cuda or cuda:N")
    if cfg.dtype not in DTYPES:
        bad("dtype", f"{cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    if cfg.quant not in QUANTS:
        bad("quant", f"{cfg.quant!r} is not one of {', '.join(QUANTS)}")
    if cfg.eval_limit is not None and cfg.eval_limit < 1:
        bad("eval_limit", f"must be >= 1 or null (all problems), got {cfg.eval_limit}")
    from ..tasks.options import check_options

    check_options(cfg.dataset_name, cfg.dataset_config, "dataset_config")
    if cfg.eval_dataset_name:
        check_options(cfg.eval_dataset_name, cfg.eval_dataset_config, "eval_dataset_config")
