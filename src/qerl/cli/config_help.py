"""`qerl train --help`: every GRPOConfig field as a flag, with its type, default and help, in
groups as TRL documents its GRPOConfig (model, data, generation, loss, ...). Where a bare
`qerl train` (the embedded default run) trains with another value, the help shows that too.

The flags only document and collect: their values reach GRPOConfig.with_overrides as text, the
same path as `--field value` pairs always took, so typing and errors stay in one place."""

from __future__ import annotations

import argparse
import dataclasses
import typing

GROUPS = {
    "model": ("model_name_or_path", "quant", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
              "train_norms", "dtype", "lora_dtype", "device", "trust_remote_code", "modules_to_not_convert", "lm_head_4bit", "embed_4bit"),
    "data": ("dataset_name", "dataset_config", "system_prompt", "prompt_suffix", "max_prompt_length"),
    "generation": ("num_generations", "generation_batch_size", "max_completion_length", "temperature", "top_p", "top_k",
                   "dynamic_sampling", "max_resample_rounds", "rollout_kv_cache_gb", "rollout_kv_cache_dtype",
                   "steps_per_generation", "max_staleness"),
    "tools": ("max_turns", "tool_timeout_s", "tool_max_output_chars"),
    "loss": ("loss_type", "importance_sampling_level", "epsilon", "epsilon_high", "top_entropy_quantile",
             "entropy_coef", "beta", "use_bias_correction_kl", "scale_rewards", "num_iterations", "token_normalizer",
             "delta", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
             "vespo_k_neg", "vespo_lambda_neg",
             "mask_truncated_completions", "overlong_buffer_len", "overlong_penalty_factor",
             "importance_sampling_correction", "importance_sampling_mode", "importance_sampling_cap",
             "importance_sampling_cap_min", "off_policy_mask_threshold", "reward_weights"),
    "optimization": ("learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "adam_beta1", "adam_beta2",
                     "adam_epsilon", "max_grad_norm", "optim", "max_steps", "per_device_train_batch_size",
                     "gradient_accumulation_steps", "gradient_checkpointing", "logprob_chunk_size", "packed_update", "seed"),
    "AQN": ("aqn", "aqn_schedule", "aqn_stages", "aqn_sigma_start", "aqn_sigma_end", "aqn_adaptive_signal",
            "aqn_adaptive_target", "aqn_adaptive_gain", "aqn_in_training"),
    "evaluation": ("eval_steps", "eval_on_start", "eval_on_end", "eval_dataset_name", "eval_dataset_config",
                   "eval_limit", "eval_num_samples", "eval_temperature", "eval_top_p", "eval_max_completion_length"),
    "logging": ("logging_steps", "report_to", "run_name"),
    "checkpoints": ("output_dir", "overwrite_output_dir", "save_strategy", "save_steps", "save_total_limit"),
    "parity": ("parity_check_steps", "parity_max_logprob_diff"),
    "distributed": ("ddp_timeout", "ddp_backend"),
}
ALIASES = {"model_name_or_path": ("--model",)}  # TRL's scripts and most users say --model
PREFIX = "config__"  # namespace attributes that hold config values


def type_name(hint) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    name = getattr(args[0], "__name__", str(args[0]))
    return {"dict": "mapping", "list": "list"}.get(name, name) + (" or null" if type(None) in typing.get_args(hint) else "")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    from ..rl import GRPOConfig
    from ..rl.config import FIELD_ALIASES

    aliases = dict(ALIASES)
    for other, name in FIELD_ALIASES.items():  # TRL's names and qerl's older ones
        aliases[name] = aliases.get(name, ()) + (f"--{other}",)
    hints = typing.get_type_hints(GRPOConfig)
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig)}
    defaults = GRPOConfig.__new__(GRPOConfig)  # defaults without running validation
    for f in fields.values():
        setattr(defaults, f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
    bare = bare_run_values()
    for group, names in GROUPS.items():
        g = parser.add_argument_group(f"{group} (config fields)")
        for name in names:
            if name not in fields:
                continue  # a field removed from GRPOConfig: tests/test_bad_inputs.py says which
            t = type_name(hints[name])
            flags = [f"--{name}"] + list(aliases.get(name, ()))  # --lora-r still works (cli.run_config.parse_overrides)
            d = getattr(defaults, name)
            shown = "null" if d is None else repr(d)
            # a bare `qerl train` is the default run, whose values differ from the config defaults in places
            run = f"a bare `qerl train`: {bare[name]!r}; " if name in bare and bare[name] != d else ""
            text = f"{fields[name].metadata.get('help', '')} [{t}; {run}default: {shown}]"
            kw = dict(nargs="?", const="true") if t == "bool" else {}  # a bare --aqn means true
            g.add_argument(*flags, dest=PREFIX + name, default=argparse.SUPPRESS, metavar=t.split()[0].upper(),
                           help=text.replace("%", "%%"), **kw)


def bare_run_values() -> dict:
    """The values a bare `qerl train` (the embedded default run, on this machine) trains with."""
    import dataclasses as dc

    from ..rl.default_run import default_run_config

    try:
        cfg = default_run_config(None)
    except Exception:  # noqa: BLE001 - help must still print
        return {}
    return {f.name: getattr(cfg, f.name) for f in dc.fields(cfg)}


def config_values(args: argparse.Namespace) -> dict[str, str]:
    """The config fields given as flags, as text (GRPOConfig types them)."""
    return {k[len(PREFIX):]: v for k, v in vars(args).items() if k.startswith(PREFIX)}
