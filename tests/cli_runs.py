"""What the command-line tests share besides conftest's `cli`, `model` and `no_model_load` fixtures: the
flags of a short run on the tiny model, and what a one-line error looks like."""

from __future__ import annotations


def train_args(model, out, *extra):
    """`qerl train` of two steps of 4 completions on the tiny model, a checkpoint each step, no evaluation
    (flags in `extra` come last and win)."""
    return ["train", "--model", model, "--dataset_name", "arithmetic", "--dataset_config", "{size: 16, eval_size: 4}",
            "--max_steps", "2", "--generation_batch_size", "4", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--max_completion_length", "4", "--max_prompt_length", "64",
            "--aqn_stages", "2", "--save_steps", "1", "--report_to", "none", "--parity_check_steps", "0",
            "--optim", "adamw_torch", "--eval_on_start", "false", "--eval_on_end", "false", "--output_dir", out, *extra]


def sft_args(model, out, *extra):
    """`qerl sft` of one step on the tiny model."""
    return ["sft", "--model_name_or_path", model, "--max_steps", "1", "--per_device_train_batch_size", "2",
            "--max_length", "128", "--report_to", "none", "--output_dir", out, *extra]


def one_line(err: str) -> bool:
    return len([x for x in err.splitlines() if x.strip()]) == 1
