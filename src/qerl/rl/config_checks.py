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


MAX_SEED = 2**32 - 1  # numpy's and the engine's generators take 32-bit seeds; larger ones overflow
MAX_TOOL_TIMEOUT_S = 86_400.0  # a day; threading's waits overflow on larger values (inf: OverflowError)
MIN_PARITY_DIFF = 1e-4  # engine and trainer differ by ~1e-7 nats of float rounding even when they agree


def check_ranges(cfg) -> None:
    """Every numeric field in its valid range (issue 34: inf / 1e30 / -1 were accepted and ended as NaN
    metrics, a 40x gradient norm, or every checkpoint deleted as it was written)."""
    def bad(name, msg):
        raise ValueError(f"config field '{name}': {msg}, got {getattr(cfg, name)!r}")

    def finite(name, lo=None, hi=None, lo_open=False, hi_open=False, null=False):
        v = getattr(cfg, name)
        if v is None and null:
            return
        lo_ok = lo is None or (v > lo if lo_open else v >= lo)
        hi_ok = hi is None or (v < hi if hi_open else v <= hi)
        if v is None or not math.isfinite(v) or not lo_ok or not hi_ok:
            rng = (("(" if lo_open else "[") + ("-inf" if lo is None else f"{lo:g}") + ", "
                   + ("inf" if hi is None else f"{hi:g}") + (")" if hi_open or hi is None else "]"))
            bad(name, f"must be a finite number in {rng}" + (" or null" if null else ""))

    finite("learning_rate", 0, 1, lo_open=True)
    finite("weight_decay", 0)
    finite("adam_beta1", 0, 1, hi_open=True)
    finite("adam_beta2", 0, 1, hi_open=True)
    finite("adam_epsilon", 0, lo_open=True)
    finite("max_grad_norm", 0)
    finite("temperature", 0, lo_open=True)
    finite("top_p", 0, 1, lo_open=True)
    finite("epsilon", 0, 1, hi_open=True)  # the ratio's lower clip is 1 - epsilon
    finite("epsilon_high", 0, null=True)
    finite("beta", 0)
    finite("overlong_penalty_factor", 0)
    finite("importance_sampling_cap", 1)
    finite("aqn_sigma_start", 0, 1)  # relative noise on norm weights of ~1: beyond it the model is noise
    finite("aqn_sigma_end", 0, 1)
    if cfg.aqn and cfg.aqn_schedule == "exponential" and cfg.aqn_sigma_start == 0:
        bad("aqn_sigma_start", "must be > 0 for the exponential schedule (it decays by ratios; aqn: false turns "
            "the noise off)")
    finite("aqn_adaptive_gain", 0)
    if cfg.aqn_adaptive_signal == "zero_variance":
        finite("aqn_adaptive_target", 0, 1, null=True)  # a fraction of groups
    else:
        finite("aqn_adaptive_target", 0, null=True)
    finite("eval_temperature", 0)
    finite("eval_top_p", 0, 1, lo_open=True)
    finite("rollout_kv_cache_gb", 0, lo_open=True, null=True)
    finite("tool_timeout_s", 0, MAX_TOOL_TIMEOUT_S, lo_open=True)
    finite("parity_max_logprob_diff", MIN_PARITY_DIFF, null=True)
    for name, lo in (("warmup_steps", 0), ("max_prompt_length", 1), ("top_k", 0), ("max_resample_rounds", 0),
                     ("overlong_buffer_len", 0), ("logging_steps", 0), ("tool_max_output_chars", 1)):
        if getattr(cfg, name) < lo:
            bad(name, f"must be >= {lo}")
    if cfg.overlong_buffer_len >= cfg.max_completion_length and cfg.overlong_buffer_len:
        bad("overlong_buffer_len", f"must be below max_completion_length ({cfg.max_completion_length})")
    if cfg.eval_max_completion_length is not None and cfg.eval_max_completion_length < 1:
        bad("eval_max_completion_length", "must be >= 1 or null")
    if cfg.save_total_limit is not None and cfg.save_total_limit < 1:
        bad("save_total_limit", "must be >= 1 (checkpoints kept) or null (all); 0 or less would delete every "
            "checkpoint as it is written")
    if not 0 <= cfg.seed <= MAX_SEED:
        bad("seed", f"must be in [0, {MAX_SEED}] (2**32 - 1)")
    if not cfg.lora_target_modules:
        bad("lora_target_modules", "is empty: no layer would get LoRA and nothing would train (e.g. [q, k, v, o, "
            "gate, up, down])")
    if cfg.reward_weights is not None and not all(math.isfinite(w) for w in cfg.reward_weights):
        bad("reward_weights", "must be finite numbers")
    if cfg.ddp_backend not in (None, "nccl", "gloo"):
        bad("ddp_backend", "must be nccl, gloo or null")
