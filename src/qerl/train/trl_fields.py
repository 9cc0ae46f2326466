"""TRL's config fields and what qerl does with each: the one table for qerl.trl's GRPOConfig / SFTConfig, qerl's
own configs (rl/config.py, sft/config.py) and `qerl train` / `qerl sft` of a TRL config file. It lives outside
qerl.trl, whose __init__ imports the trainers, because the core configs import it.

A `trl grpo --config` / `trl sft --config` file, or `qerl.trl.GRPOConfig(...)` / `SFTConfig(...)`, may hold any
field of the dataclasses TRL's scripts parse: GRPOConfig or SFTConfig (transformers' TrainingArguments under
TRL's _BaseConfig), ModelConfig, ScriptArguments (GRPOScriptArguments for grpo) and DatasetMixtureConfig.
A field that qerl's config has (or has under another name: `renamed`, rl/config.py FIELD_ALIASES) is qerl's;
those the TRL surface reads itself (TRLArgs: steps, epochs, completions table, run name, evaluation, hub) are
taken out by `split` and ride as `cfg.trl`; every other one follows `sort_out`:

- ANY_VALUE: no effect on what is trained (logging, hub, trackers, data loader, TRL's engines, precision
  flags qerl sets itself): ignored at any value, named in the one-line notice;
- otherwise it would change the result: accepted at TRL's default (named in the notice, "at TRL's default"),
  and refused by name in one line at any other value, with the nearest qerl field (NEAREST).

qerl cannot import TRL at run time, so the defaults are the generated block below, written from TRL's
dataclasses (TRL 1.16.0, transformers 5.25.0) by

    PYTHONPATH=src python -m qerl.train.trl_fields

in a Python where TRL 1.16 imports (the project's venv, or TRL's folder on PYTHONPATH), which rewrites the block
in place and keeps the rest of the file; tests/test_trl_defaults_file.py checks the block against TRL's dataclasses.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass

# transformers 4's fields that files written for it still carry (TrainingArguments 5 has none): TRL's default then
OLDER = {"warmup_ratio": 0.0}

# --- generated: TRL's defaults (do not edit by hand; see the module's doc) --------------------------------------
# TRL 1.16.0, transformers 5.25.0. BASE: TRL's _BaseConfig (TrainingArguments
# with TRL's defaults); GRPO / SFT: GRPOConfig's / SFTConfig's fields and defaults besides BASE's; MODEL:
# ModelConfig; SCRIPT: ScriptArguments and DatasetMixtureConfig; GRPO_SCRIPT: GRPOScriptArguments' own
BASE: dict = {'output_dir': None,
 'per_device_train_batch_size': 8,
 'num_train_epochs': 3.0,
 'max_steps': -1,
 'learning_rate': 5e-05,
 'lr_scheduler_type': 'linear',
 'lr_scheduler_kwargs': None,
 'warmup_steps': 0,
 'optim': 'adamw_torch_fused',
 'optim_args': None,
 'weight_decay': 0.0,
 'adam_beta1': 0.9,
 'adam_beta2': 0.999,
 'adam_epsilon': 1e-08,
 'optim_target_modules': None,
 'gradient_accumulation_steps': 1,
 'average_tokens_across_devices': True,
 'max_grad_norm': 1.0,
 'label_smoothing_factor': 0.0,
 'bf16': None,
 'fp16': False,
 'bf16_full_eval': False,
 'fp16_full_eval': False,
 'tf32': None,
 'activation_checkpointing': None,
 'activation_checkpointing_kwargs': None,
 'gradient_checkpointing': True,
 'gradient_checkpointing_kwargs': None,
 'torch_compile': False,
 'torch_compile_backend': None,
 'torch_compile_mode': None,
 'use_liger_kernel': False,
 'liger_kernel_config': None,
 'use_cache': False,
 'neftune_noise_alpha': None,
 'torch_empty_cache_steps': None,
 'auto_find_batch_size': False,
 'logging_strategy': 'steps',
 'logging_steps': 10,
 'logging_first_step': False,
 'log_on_each_node': True,
 'logging_nan_inf_filter': True,
 'include_num_input_tokens_seen': 'no',
 'log_level': 'passive',
 'log_level_replica': 'warning',
 'disable_tqdm': None,
 'report_to': 'none',
 'run_name': None,
 'project': 'huggingface',
 'trackio_space_id': None,
 'trackio_bucket_id': None,
 'trackio_static_space_id': None,
 'eval_strategy': 'no',
 'eval_steps': None,
 'eval_delay': 0,
 'per_device_eval_batch_size': 8,
 'prediction_loss_only': False,
 'eval_on_start': False,
 'eval_do_concat_batches': True,
 'eval_use_gather_object': False,
 'eval_accumulation_steps': None,
 'include_for_metrics': [],
 'batch_eval_metrics': False,
 'save_only_model': False,
 'save_strategy': 'steps',
 'save_steps': 500,
 'save_on_each_node': False,
 'save_total_limit': None,
 'enable_jit_checkpoint': False,
 'push_to_hub': False,
 'hub_token': None,
 'hub_private_repo': None,
 'hub_model_id': None,
 'hub_strategy': 'every_save',
 'hub_always_push': False,
 'hub_revision': None,
 'load_best_model_at_end': False,
 'metric_for_best_model': None,
 'greater_is_better': None,
 'ignore_data_skip': False,
 'restore_callback_states_from_checkpoint': False,
 'full_determinism': False,
 'seed': 42,
 'data_seed': None,
 'use_cpu': False,
 'accelerator_config': None,
 'parallelism_config': None,
 'dataloader_drop_last': False,
 'dataloader_num_workers': 0,
 'dataloader_pin_memory': True,
 'dataloader_persistent_workers': False,
 'dataloader_prefetch_factor': None,
 'dataloader_multiprocessing_context': None,
 'dataloader_in_order': True,
 'remove_unused_columns': True,
 'label_names': None,
 'train_sampling_strategy': 'random',
 'length_column_name': 'length',
 'ddp_find_unused_parameters': None,
 'ddp_bucket_cap_mb': None,
 'ddp_broadcast_buffers': None,
 'ddp_static_graph': None,
 'ddp_backend': None,
 'ddp_timeout': 1800,
 'fsdp': None,
 'fsdp_config': None,
 'deepspeed': None,
 'debug': '',
 'skip_memory_metrics': True,
 'do_train': False,
 'do_eval': False,
 'do_predict': False,
 'resume_from_checkpoint': None,
 'local_rank': -1}
GRPO: dict = {'learning_rate': 1e-06,
 'remove_unused_columns': False,
 'model_init_kwargs': None,
 'trust_remote_code': False,
 'router_aux_loss_coef': None,
 'disable_dropout': False,
 'cast_lm_head_to_fp32': False,
 'num_generations': 8,
 'num_generations_eval': None,
 'max_completion_length': 512,
 'ds3_gather_for_generation': True,
 'shuffle_dataset': True,
 'pad_to_multiple_of': 'auto',
 'generation_batch_size': None,
 'steps_per_generation': None,
 'temperature': 1.0,
 'top_p': 1.0,
 'top_k': 0,
 'min_p': None,
 'generation_kwargs': None,
 'chat_template_kwargs': None,
 'repetition_penalty': 1.0,
 'cache_implementation': None,
 'use_vllm': False,
 'vllm_mode': 'colocate',
 'vllm_model_impl': 'vllm',
 'vllm_enable_sleep_mode': False,
 'vllm_structured_outputs_regex': None,
 'vllm_server_base_url': None,
 'vllm_server_host': '0.0.0.0',
 'vllm_server_port': 8000,
 'vllm_server_timeout': 240.0,
 'vllm_group_port': 51216,
 'vllm_gpu_memory_utilization': 0.3,
 'vllm_max_model_length': None,
 'vllm_tensor_parallel_size': 1,
 'beta': 0.0,
 'num_iterations': 1,
 'epsilon': 0.2,
 'delta': None,
 'epsilon_high': None,
 'sapo_temperature_neg': 1.05,
 'sapo_temperature_pos': 1.0,
 'vespo_k_pos': 2.0,
 'vespo_lambda_pos': 3.0,
 'vespo_k_neg': 3.0,
 'vespo_lambda_neg': 2.0,
 'importance_sampling_level': 'token',
 'reward_weights': None,
 'multi_objective_aggregation': 'sum_then_normalize',
 'scale_rewards': 'group',
 'loss_type': 'dapo',
 'mask_truncated_completions': False,
 'sync_ref_model': False,
 'ref_model_mixup_alpha': 0.6,
 'ref_model_sync_steps': 512,
 'top_entropy_quantile': 1.0,
 'entropy_coef': 0.0,
 'use_adaptive_entropy': False,
 'entropy_coef_min': 0.0,
 'entropy_coef_max': 1.0,
 'entropy_coef_delta': 0.005,
 'entropy_target': 0.2,
 'max_tool_calling_iterations': None,
 'vllm_importance_sampling_correction': True,
 'vllm_importance_sampling_mode': 'sequence_mask',
 'vllm_importance_sampling_clip_max': 3.0,
 'vllm_importance_sampling_clip_min': None,
 'off_policy_mask_threshold': None,
 'use_bias_correction_kl': True,
 'log_completions': False,
 'log_multimodal': True,
 'num_completions_to_print': None,
 'log_unique_prompts': False,
 'log_completions_hub_repo': None,
 'use_transformers_continuous_batching': False,
 'transformers_continuous_batching_config': None,
 'use_transformers_paged': False,
 'vllm_importance_sampling_cap': None}
SFT: dict = {'learning_rate': 2e-05,
 'model_init_kwargs': None,
 'trust_remote_code': False,
 'router_aux_loss_coef': None,
 'chat_template_path': None,
 'dataset_text_field': 'text',
 'dataset_kwargs': None,
 'dataset_num_proc': None,
 'eos_token': None,
 'max_length': 1024,
 'truncation_mode': 'keep_start',
 'shuffle_dataset': False,
 'packing': False,
 'packing_strategy': 'bfd',
 'padding_free': False,
 'pad_to_multiple_of': 'auto',
 'eval_packing': None,
 'completion_only_loss': None,
 'assistant_only_loss': False,
 'loss_type': 'nll',
 'activation_offloading': False,
 'pad_token': None}
MODEL: dict = {'model_name_or_path': None,
 'model_revision': 'main',
 'dtype': 'float32',
 'attn_implementation': None,
 'use_peft': False,
 'lora_r': 16,
 'lora_alpha': 32,
 'lora_dropout': 0.05,
 'lora_target_modules': None,
 'lora_target_parameters': None,
 'lora_modules_to_save': None,
 'lora_task_type': 'CAUSAL_LM',
 'use_rslora': False,
 'use_dora': False,
 'load_in_8bit': False,
 'load_in_4bit': False,
 'bnb_4bit_quant_type': 'nf4',
 'use_bnb_nested_quant': False,
 'bnb_4bit_quant_storage': None}
SCRIPT: dict = {'dataset_name': None,
 'dataset_config': None,
 'dataset_train_split': 'train',
 'dataset_test_split': 'test',
 'dataset_streaming': False,
 'ignore_bias_buffers': False,
 'datasets': [],
 'streaming': False,
 'test_split_size': None}
GRPO_SCRIPT: dict = {'reward_model_name_or_path': None, 'reward_funcs': None}
# --- end of generated -------------------------------------------------------------------------------------------

# qerl's fields whose TRL default is None, "unset: the trainer decides": None there is qerl's default
UNSET_IS_QERLS = frozenset({"eval_steps", "lora_target_modules", "dataset_config"})

# Fields that do not change what is trained: ignored at any value, with the notice.
ANY_VALUE = frozenset("""
    use_vllm vllm_mode vllm_model_impl vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url
    vllm_server_host vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization
    vllm_max_model_length vllm_tensor_parallel_size ds3_gather_for_generation cast_lm_head_to_fp32
    pad_to_multiple_of cache_implementation use_transformers_paged use_transformers_continuous_batching
    transformers_continuous_batching_config model_init_kwargs log_completions
    log_completions_hub_repo log_multimodal log_unique_prompts num_completions_to_print remove_unused_columns
    bf16 fp16 tf32 bf16_full_eval fp16_full_eval use_cpu push_to_hub hub_model_id hub_strategy hub_token
    hub_private_repo hub_always_push hub_revision project logging_strategy logging_first_step
    logging_nan_inf_filter log_level log_level_replica log_on_each_node save_only_model
    save_on_each_node eval_strategy do_train do_eval do_predict per_device_eval_batch_size eval_accumulation_steps
    dataloader_num_workers dataloader_pin_memory dataloader_persistent_workers dataloader_prefetch_factor
    dataloader_drop_last dataloader_in_order dataloader_multiprocessing_context disable_tqdm
    torch_empty_cache_steps skip_memory_metrics use_liger_kernel liger_kernel_config torch_compile_backend
    torch_compile_mode local_rank trackio_space_id trackio_bucket_id trackio_static_space_id
    ignore_data_skip include_num_input_tokens_seen average_tokens_across_devices ddp_find_unused_parameters
    ddp_bucket_cap_mb ddp_broadcast_buffers ddp_static_graph use_cache num_train_epochs
    attn_implementation lora_task_type dataset_test_split
    dataset_streaming load_in_4bit load_in_8bit bnb_4bit_quant_type use_bnb_nested_quant bnb_4bit_quant_storage
    dataset_num_proc dataset_kwargs eval_packing
    eval_steps eval_delay eval_on_start prediction_loss_only eval_do_concat_batches eval_use_gather_object
    include_for_metrics batch_eval_metrics test_split_size streaming enable_jit_checkpoint
    restore_callback_states_from_checkpoint debug length_column_name ignore_bias_buffers logging_dir
    ref_model_mixup_alpha ref_model_sync_steps entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target
""".split())
# (the last line: read only with sync_ref_model / use_adaptive_entropy on, which are refused)

# TRL's full fine-tuning, asked by a field's value (the first; also unset, None) or by a trainer built without a
# peft_config: not carried out, said in a line of its own at start-up (not_carried_out), and qerl trains anyway;
# the field's other value is what qerl does (named with the ignored fields)
FULL_FINE_TUNING = ("(TRL's default: full fine-tuning of every weight) is not carried out: qerl always trains a LoRA "
                    "adapter (lora_r, lora_alpha, lora_target_modules) on the frozen 4-bit base, whose weights never "
                    "change")
NOT_CARRIED_OUT = {
    "use_peft": (False, "set use_peft: true to say so"),
    "peft_config": (None, "pass peft_config=LoraConfig(...) to say so"),  # qerl.trl's trainers (grpo.py, sft.py)
}

# qerl.trl's note in a run's config.yaml when its trainer was given in-memory objects (a model, a processing_class):
# model_name_or_path then names where the model was loaded from, not a change made to it in memory. No config field:
# read back (a resume, qerl evaluate) it is said in one line and dropped (sort_out)
IN_MEMORY = "in_memory"
IN_MEMORY_NOTE = ("model_name_or_path is the model's name_or_path, where it was loaded from (a change made to it in "
                  "memory is not there)")
IN_MEMORY_COMMENT = "# qerl.trl: given as in-memory objects; "


def in_memory_note(config_yaml: str) -> str:
    """The in-memory note's lines (its comment and `in_memory: ...`) in a run's config.yaml text, else ''."""
    lines = config_yaml.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"{IN_MEMORY}:"):
            comment = lines[i - 1] + "\n" if i and lines[i - 1].startswith(IN_MEMORY_COMMENT) else ""
            return f"{comment}{line}\n"
    return ""


# Fields that would change the result: (other values that change nothing, the nearest qerl field or what to do)
NEAREST = {
    "lr_scheduler_kwargs": ((None, {}), "lr_scheduler_type (constant | linear | cosine) with warmup_steps"),
    "data_seed": ((None,), "seed (it seeds the data order too)"),  # equal to seed: changes nothing (sort_out)
    "load_best_model_at_end": ((False,), "save_total_limit: every checkpoint is kept under output_dir/checkpoint-N "
                                         "and the last adapter in output_dir/adapter"),
    "metric_for_best_model": ((None,), "none: qerl keeps no best model (see load_best_model_at_end)"),
    "greater_is_better": ((None,), "none: qerl keeps no best model (see load_best_model_at_end)"),
    "torch_compile": ((False, None), "none: qerl runs its own kernels"),
    "label_smoothing_factor": ((0, 0.0), "none: the loss is TRL's GRPO/SFT loss"),
    "optim_args": ((None, ""), "optim (adamw_torch | adamw_8bit) with adam_beta1, adam_beta2, adam_epsilon, "
                               "weight_decay"),
    "optim_target_modules": ((), "optim (adamw_torch | adamw_8bit)"),
    "gradient_checkpointing_kwargs": ((None, {}, {"use_reentrant": False}, {"use_reentrant": True}),
                                      "gradient_checkpointing"),
    "activation_checkpointing_kwargs": ((None, {}, {"use_reentrant": False}, {"use_reentrant": True}),
                                        "gradient_checkpointing"),
    "neftune_noise_alpha": ((), "none: qerl adds no embedding noise (aqn is noise on the quantized weights)"),
    "full_determinism": ((), "seed"),
    "auto_find_batch_size": ((), "per_device_train_batch_size"),
    "train_sampling_strategy": ((), "none: qerl samples the examples at random, seeded by seed"),
    "label_names": ((), "none: the labels are TRL's (the completion / the text)"),
    "fsdp": (("",), "torchrun --nproc_per_node N (qerl's data-parallel ranks)"),
    "fsdp_config": (({},), "torchrun --nproc_per_node N (qerl's data-parallel ranks)"),
    "deepspeed": (("",), "torchrun --nproc_per_node N (qerl's data-parallel ranks)"),
    "accelerator_config": (({},), "torchrun --nproc_per_node N (qerl's data-parallel ranks)"),
    "parallelism_config": ((), "torchrun --nproc_per_node N (qerl's data-parallel ranks)"),
    "router_aux_loss_coef": ((), "none: qerl adds no router auxiliary loss"),
    # qerl.trl's configs and TRL config files take it (warmup_ratio below); qerl's own configs name the fix
    "warmup_ratio": ((None,), "warmup_steps (optimizer updates of warm-up), or qerl.trl's GRPOConfig / SFTConfig, "
                              "which take TRL's ratio"),
    # GRPO
    "use_adaptive_entropy": ((), "entropy_coef (a fixed coefficient)"),
    "sync_ref_model": ((), "beta (the KL to the starting policy)"),
    "min_p": ((), "top_p, top_k"),
    "multi_objective_aggregation": ((), "reward_weights (weighted sum, then the group's normalization)"),
    "repetition_penalty": ((), "none: qerl samples from the policy's own distribution"),
    "num_generations_eval": ((), "eval_num_samples"),
    "generation_kwargs": (({},), "temperature, top_p, top_k, max_completion_length"),
    "max_tool_calling_iterations": ((), "max_turns"),
    "disable_dropout": ((), "lora_dropout"),
    # SFT
    "eos_token": ((), "processing_class: a tokenizer whose eos_token is the one you want"),
    "pad_token": ((), "processing_class: a tokenizer whose pad_token is the one you want"),
    "packing_strategy": (("bfd",), "packing=True (qerl packs a micro-batch's examples into shared rows)"),
    "truncation_mode": (("keep_start",), "max_length (examples are cut at their end, TRL's keep_start)"),
    "loss_type": (("nll",), "none: qerl's SFT loss is the negative log-likelihood"),
    "activation_offloading": ((), "gradient_checkpointing"),
    "chat_template_path": ((), "processing_class: a tokenizer with the chat template you want"),
    # ModelConfig, the scripts' dataset arguments
    "use_rslora": ((), "lora_alpha (the scale is lora_alpha / lora_r)"),
    "use_dora": ((), "lora_r, lora_alpha"),
    "lora_modules_to_save": (([],), "train_norms (the norms trained with the adapter)"),
    "lora_target_parameters": (([],), "lora_target_modules"),
    "datasets": ((), "dataset_name (one dataset; a local file holds a mixture)"),
    "dataset_train_split": ((), "dataset_config: {split: NAME} (a hub dataset's split)"),
    # TRL's SFT default is False and its sampler shuffles anyway, as qerl's does: True changes nothing there
    "shuffle_dataset": ((True,), "seed (qerl draws the prompts / examples in a seeded random order)"),
    "chat_template_kwargs": (({},), "system_prompt, or processing_class: a tokenizer whose chat template renders "
                                    "the prompts as you want"),
    "model_revision": ((None,), "model_name_or_path: a local folder of that revision"),
    # read by TRL's scripts (trainer.train(resume_from_checkpoint=...)); qerl.trl and `qerl sft` take it themselves
    "resume_from_checkpoint": ((None, False, ""), "qerl train --resume OUTPUT_DIR (the run folder; its latest "
                                                  "checkpoint)"),
}


def defaults(kind: str) -> dict:
    """Every field of TRL's `trl grpo` (kind "grpo") or `trl sft` ("sft") script and its TRL default."""
    own = {"grpo": {**GRPO, **GRPO_SCRIPT}, "sft": SFT}[kind]
    return {**OLDER, **MODEL, **SCRIPT, **BASE, **own}


def default_of(name: str, kind: str):
    """TRL's default of `name` in `kind`'s script (else in the other's, else None)."""
    for k in (kind, "sft" if kind == "grpo" else "grpo"):
        table = defaults(k)
        if name in table:
            return table[name]
    return None


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, bool) != isinstance(b, bool):
        return False  # 0 is not False here: a YAML 0 for a flag is a typo worth refusing
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an odd value is simply not the default
        return False


def no_op(name: str, value, kind: str, seed=42) -> bool:
    """Whether TRL's `name` at `value` is what qerl does without it (TRL's default or a value equal to it)."""
    fine = NEAREST.get(name, ((), ""))[0]
    if name == "data_seed" and value == seed:
        return True
    return _same(value, default_of(name, kind)) or any(_same(value, f) for f in fine)


def refusal(name: str, value, kind: str) -> ValueError:
    nearest = NEAREST.get(name, ((), "none"))[1]
    return ValueError(f"{name}={value!r} is not implemented in qerl (only TRL's default, "
                      f"{default_of(name, kind)!r}); nearest: {nearest}")


def sort_out(d: dict, kind: str, own, source: str, also_ignored=()) -> dict:
    """`d` less TRL's fields that qerl's config (`own`: its field names and aliases) lacks: those without an
    effect, and the others at TRL's default, named in one line; another value of the others refused by name with
    the nearest field. A name in no table stays (qerl's config says "unknown field ... did you mean"); one of
    UNSET_IS_QERLS at None is left out (qerl's default).
    also_ignored: names the caller took out and does not act on, added to the line."""
    table = defaults(kind)  # the other script's own fields are "unknown field" (did you mean), but ANY_VALUE's
    rest, ignored, at_default, lines = {}, [], [], []
    for k, v in d.items():
        if k == IN_MEMORY and k not in own:  # a warning: stdout stays --print_config's file
            print(f"qerl: {source}: {k}: {v} were given to qerl.trl as in-memory objects; {IN_MEMORY_NOTE}",
                  file=sys.stderr, flush=True)
        elif k in own or not (k in table or k in ANY_VALUE or k in NEAREST):
            if not (v is None and k in UNSET_IS_QERLS and k in own):
                rest[k] = v
        elif k in NOT_CARRIED_OUT:
            if _same(v, NOT_CARRIED_OUT[k][0]) or v is None:
                lines.append(not_carried_out(k, v, source))
            else:
                ignored.append(k)  # the value qerl carries out anyway
        elif k in ANY_VALUE:
            ignored.append(k)
        elif no_op(k, v, kind, seed=d.get("seed", 42)):
            at_default.append(k)
        else:
            raise ValueError(f"{source}: {refusal(k, v, kind)}")
    ignored += [k for k in also_ignored if k not in ignored]
    notice(source, ignored, at_default)
    for line in lines:
        print(line, flush=True)
    return rest


def not_carried_out(name: str, value, source: str) -> str:
    """The start-up line of TRL's full fine-tuning asked by `name` (NOT_CARRIED_OUT): one rule for a config's
    use_peft: false and a qerl.trl trainer built without peft_config."""
    return f"qerl: {source}: {name}={value!r} {FULL_FINE_TUNING}; {NOT_CARRIED_OUT[name][1]}"


def notice(source: str, ignored, at_default=()) -> None:
    parts = []
    if ignored:
        parts.append(f"ignored: {', '.join(ignored)}")
    if at_default:
        parts.append(f"at TRL's default (another value is refused): {', '.join(at_default)}")
    if parts:
        print(f"qerl: {source}: TRL field(s) without an effect in qerl, {'; '.join(parts)}", flush=True)


# --- the TRL surface's own fields and TRL's other names of qerl's ------------------------------------------------

TRL_EPOCHS = 3.0  # TrainingArguments' num_train_epochs default


@dataclass
class TRLArgs:
    """The fields the TRL surface (qerl.trl) reads; a config carries them as `cfg.trl`."""
    max_steps: int = -1                 # TRL's: optimizer steps (-1: num_train_epochs)
    num_train_epochs: float = TRL_EPOCHS
    log_completions: bool = False
    num_completions_to_print: int | None = None
    log_unique_prompts: bool = False
    run_name: str | None = None
    eval_strategy: str = "no"
    eval_steps: float | None = None     # TRL's: None means logging_steps
    per_device_eval_batch_size: int = 8  # TrainingArguments': completions an eval batch (TRL's eval_loss)
    warmup_ratio: float = 0.0
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    resume_from_checkpoint: str | None = None  # TrainingArguments': read by scripts, not by Trainer
    max_prompt_length: int | None = None       # qerl's field, when the script sets it (TRL 1.16 has none)


RENAMED = {"activation_checkpointing": "gradient_checkpointing"}  # transformers 5's name -> qerl's field

EVAL_STRATEGIES = ("no", "steps")


def refuse(name: str, value, nearest: str) -> ValueError:
    """A TRL argument qerl.trl does not carry out (a trainer's argument, a surface field's value), by name."""
    return ValueError(f"{name}={value!r} is not supported by qerl; nearest: {nearest}")


def split(kw: dict, source: str = "config") -> tuple[TRLArgs, dict]:
    """(the TRL surface's fields, the rest for qerl's config) of a TRL config's keyword arguments."""
    kw = dict(kw)
    mine = {f.name: kw.pop(f.name) for f in dataclasses.fields(TRLArgs) if f.name in kw and f.name != "warmup_ratio"}
    trl = TRLArgs(**mine)
    if trl.max_prompt_length is not None:
        kw["max_prompt_length"] = trl.max_prompt_length
    kw = renamed(kw)
    if trl.eval_strategy not in EVAL_STRATEGIES:
        raise refuse("eval_strategy", trl.eval_strategy, "eval_strategy='steps' with eval_steps")
    trl.warmup_ratio, kw = warmup_ratio(kw, source)
    if trl.log_unique_prompts:
        raise refuse("log_unique_prompts", True, "log_completions (every completion of the printed prompts)")
    return trl, kw


_SAID: set[str] = set()  # what is said once a process


def warmup_ratio(kw: dict, source: str) -> tuple[float, dict]:
    """(TRL's warm-up ratio, `kw` without it): the one rule for TRL's warm-up names, in qerl.trl's GRPOConfig
    and SFTConfig and in `qerl train` / `qerl sft` of a TRL config file. transformers 5 writes the ratio as
    `warmup_steps` below 1 (0.1: a tenth of the run's optimizer steps); transformers 4's `warmup_ratio` is
    read as the same ratio, its deprecation said once. Both set is refused; a whole warmup_steps stays (optimizer
    steps). The caller turns the ratio into steps once the run's optimizer steps are known (train/optim.py
    warmup_steps: transformers' ceil(ratio x steps))."""
    kw = dict(kw)
    old = kw.pop("warmup_ratio", None)
    steps = kw.get("warmup_steps")
    if old is not None and (isinstance(old, bool) or not isinstance(old, (int, float)) or not 0 <= old <= 1):
        raise ValueError(f"{source}: warmup_ratio={old!r} must be a number from 0 to 1 (the fraction of the run's "
                         f"optimizer steps that warm up), e.g. warmup_steps: 0.1 as transformers 5 writes it")
    ratio = 0.0
    if isinstance(steps, float) and 0 < steps < 1:  # transformers 5: the ratio
        ratio = kw.pop("warmup_steps")
    if old:
        if ratio or steps:
            raise ValueError(f"{source}: warmup_ratio={old!r} and warmup_steps={steps!r} both set the warm-up; set "
                             f"one (transformers 5: warmup_steps={old!r}, a float below 1, is the ratio)")
        if "warmup_ratio" not in _SAID:
            _SAID.add("warmup_ratio")
            print(f"qerl: {source}: warmup_ratio is transformers 4's name, deprecated in transformers 5 (which writes "
                  f"it warmup_steps={old!r}, a float below 1); read as that ratio of the run's optimizer steps",
                  file=sys.stderr, flush=True)  # a warning: stdout stays --print_config's file
        ratio = float(old)
    return ratio, kw


def renamed(kw: dict) -> dict:
    """`kw` with transformers 5's names as qerl's fields (a config file's fields too); the fields qerl lacks are
    sorted out (sort_out) where qerl's config is built."""
    kw = dict(kw)
    for old, new in RENAMED.items():
        if old in kw:
            v = kw.pop(old)
            if v is None:  # unset, transformers 5's default: the other name decides, as in TrainingArguments
                continue
            if kw.get(new) is not None and kw[new] != v:
                raise ValueError(f"{old}={v!r} and {new}={kw[new]!r}: one field under two names; set one")
            kw[new] = v
    return kw


# --- the generator -----------------------------------------------------------------------------------------------

def _generate() -> str:  # pragma: no cover - needs TRL; run as the module's doc says
    import dataclasses
    import enum
    import pprint

    import transformers
    import trl
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, ScriptArguments, SFTConfig
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.trainer.base_config import _BaseConfig

    def value(f):
        if f.default is not dataclasses.MISSING:
            v = f.default
        elif f.default_factory is not dataclasses.MISSING:
            v = f.default_factory()
        else:
            v = None
        return v.value if isinstance(v, enum.Enum) else v

    def table(cls, under=None):
        under = under or {}
        out = {}
        for f in dataclasses.fields(cls):
            if not f.init or f.name.startswith("_") or (f.name in under and under[f.name] == value(f)):
                continue
            out[f.name] = value(f)
        return out

    base = table(_BaseConfig)
    script = {**table(ScriptArguments), **table(DatasetMixtureConfig)}
    blocks = {"BASE": base, "GRPO": table(GRPOConfig, base), "SFT": table(SFTConfig, base),
              "MODEL": table(ModelConfig), "SCRIPT": script, "GRPO_SCRIPT": table(GRPOScriptArguments, script)}
    lines = [f"# TRL {trl.__version__}, transformers {transformers.__version__}. BASE: TRL's _BaseConfig "
             "(TrainingArguments",
             "# with TRL's defaults); GRPO / SFT: GRPOConfig's / SFTConfig's fields and defaults besides BASE's; "
             "MODEL:",
             "# ModelConfig; SCRIPT: ScriptArguments and DatasetMixtureConfig; GRPO_SCRIPT: GRPOScriptArguments' own"]
    for name, d in blocks.items():
        text = pprint.pformat(d, width=104, sort_dicts=False)
        if eval(text) != d:  # noqa: S307 - our own repr, checked to read back as the defaults
            raise ValueError(f"{name}: a default does not read back from its repr")
        lines.append(f"{name}: dict = {text}")
    return "\n".join(lines) + "\n"


def _rewrite() -> None:  # pragma: no cover
    from pathlib import Path

    path = Path(__file__)
    text = path.read_text()
    start = text.index("\n", text.index("# --- generated:")) + 1
    end = text.index("# --- end of generated")
    path.write_text(text[:start] + _generate() + text[end:])
    print(f"wrote {path}")


if __name__ == "__main__":  # pragma: no cover
    _rewrite()
