"""Checks of GRPOConfig's own fields, run by `GRPOConfig.validate` at load time after the shared fields'
(train/checks.py), so a bad value fails before any model loads and the error names the field (issue 22:
`--lora_r -4` and `--device tpu` used to end in tracebacks; issue 34: inf / 1e30 / -1 ended as NaN metrics)."""

from __future__ import annotations

import math

from ..train.checks import at_least, bad, finite

MAX_TOOL_TIMEOUT_S = 86_400.0  # a day; threading's waits overflow on larger values (inf: OverflowError)
MIN_PARITY_DIFF = 1e-4  # engine and trainer differ by ~1e-7 nats of float rounding even when they agree


def check_inputs(cfg) -> None:
    """The evaluation's size and the task's options (tasks/options.py)."""
    at_least(cfg, "eval_limit", 1, null=True)
    from ..tasks.options import check_options

    check_options(cfg.dataset_name, cfg.dataset_config, "dataset_config")
    if cfg.eval_dataset_name:
        check_options(cfg.eval_dataset_name, cfg.eval_dataset_config, "eval_dataset_config")


def check_ranges(cfg) -> None:
    """Every numeric GRPO field in its valid range."""
    for name, lo, hi, kw in (("temperature", 0, None, dict(lo_open=True)), ("top_p", 0, 1, dict(lo_open=True)),
                             ("epsilon", 0, 1, dict(hi_open=True)),  # the ratio's lower clip is 1 - epsilon
                             ("epsilon_high", 0, None, dict(null=True)), ("beta", 0, None, {}),
                             ("overlong_penalty_factor", 0, None, {}), ("importance_sampling_cap", 1, None, {}),
                             # relative noise on norm weights of ~1: beyond it the model is noise
                             ("aqn_sigma_start", 0, 1, {}), ("aqn_sigma_end", 0, 1, {})):
        finite(cfg, name, lo, hi, **kw)
    if cfg.aqn and cfg.aqn_schedule == "exponential" and cfg.aqn_sigma_start == 0:
        bad("aqn_sigma_start", "must be > 0 for the exponential schedule (it decays by ratios; aqn: false turns "
            f"the noise off), got {cfg.aqn_sigma_start!r}")
    finite(cfg, "aqn_adaptive_gain", 0)
    if cfg.aqn_adaptive_signal == "zero_variance":
        finite(cfg, "aqn_adaptive_target", 0, 1, null=True)  # a fraction of groups
    else:
        finite(cfg, "aqn_adaptive_target", 0, null=True)
    finite(cfg, "eval_temperature", 0)
    finite(cfg, "eval_top_p", 0, 1, lo_open=True)
    finite(cfg, "rollout_kv_cache_gb", 0, lo_open=True, null=True)
    finite(cfg, "tool_timeout_s", 0, MAX_TOOL_TIMEOUT_S, lo_open=True)
    finite(cfg, "parity_max_logprob_diff", MIN_PARITY_DIFF, null=True)
    for name, lo in (("max_prompt_length", 1), ("top_k", 0), ("max_resample_rounds", 0),
                     ("overlong_buffer_len", 0), ("tool_max_output_chars", 1)):
        at_least(cfg, name, lo)
    if cfg.overlong_buffer_len >= cfg.max_completion_length and cfg.overlong_buffer_len:
        bad("overlong_buffer_len", f"must be below max_completion_length ({cfg.max_completion_length}), got "
            f"{cfg.overlong_buffer_len!r}")
    at_least(cfg, "eval_max_completion_length", 1, null=True)
    if cfg.reward_weights is not None and not all(math.isfinite(w) for w in cfg.reward_weights):
        bad("reward_weights", f"must be finite numbers, got {cfg.reward_weights!r}")
