"""The supervised fine-tuning configuration: TRL's SFTConfig names where TRL has one.

The model, optimizer, run-folder, logging and memory fields are the shared ones (train/config.py,
which GRPOConfig inherits too); the data and loss fields are SFT's own. Every field carries its help text,
so `qerl sft --print_config` writes a documented YAML file and every field is a `--flag`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..train.config import TrainConfig
from ..train.fields import _f


@dataclass
class SFTConfig(TrainConfig):
    """Supervised fine-tuning: the shared fields (train/config.py; SFT's own defaults redeclared below) and
    the data and loss fields."""
    TITLE = "qerl sft configuration"
    # --- SFT's defaults of shared fields (TRL's SFTConfig's where it has one) ------------------
    learning_rate: float = _f(1e-4, "Peak learning rate (LoRA takes a larger one than full fine-tuning).")
    lr_scheduler_type: str = _f("linear", "constant | linear | cosine (after warm-up).")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    optim: str = _f("adamw_torch", "adamw_torch | adamw_8bit (bitsandbytes, CUDA; falls back with a notice).")
    max_steps: int = _f(-1, "Optimizer updates (-1: as many as num_train_epochs takes).")
    per_device_train_batch_size: int = _f(8, "Examples per forward/backward micro-batch, on each rank.")
    seed: int = _f(42, "Seed of the data order and LoRA dropout.")
    output_dir: str = _f("runs/sft", "Run directory: metrics.jsonl, checkpoints, adapter, config.")
    save_total_limit: int | None = _f(2, "Keep this many checkpoints (null: all).")
    report_to: str = _f("auto", "auto (TensorBoard when installed) | none | tensorboard, wandb, trackio, mlflow "
                        "(comma-separated or a list; see GRPOConfig.report_to) | all.")
    # --- data ----------------------------------------------------------------------------------
    dataset_name: str = _f("tool_arithmetic", "A local .jsonl / .json / .parquet file, a hub dataset, or "
                           "'tool_arithmetic' (the tool task's supervised transcripts, from its training split). Rows "
                           "are TRL's formats: 'messages' (a conversation), 'text' (plain text, see "
                           "dataset_text_field) or 'prompt' + 'completion' (strings or message lists).")
    dataset_config: dict = _f({}, "Options: of the task for 'tool_arithmetic' (size, seed, ...); for a hub dataset "
                              "`config` and `split` (default train).")
    dataset_text_field: str = _f("text", "The column holding plain text rows.")
    max_length: int | None = _f(1024, "Tokens per example; longer ones are cut at the end (TRL's keep_start; null: "
                                "no limit).")
    packing: bool = _f(True, "Pack the examples of a micro-batch into shared rows: their common leading tokens "
                       "once, each example attending only to those and its own tokens (position ids restart, no "
                       "cross-contamination; the loss and gradients of separate rows). TRL's default is false.")
    assistant_only_loss: bool = _f(False, "Conversations: train only on the assistant turns (their content and "
                                   "end-of-turn token); system, user and tool turns are context.")
    completion_only_loss: bool | None = _f(None, "prompt + completion rows: train only on the completion (null: "
                                           "true, as TRL).")
    # --- how long ----------------------------------------------------------------------------
    num_train_epochs: float = _f(1.0, "Passes over the training examples (used when max_steps is -1).")

    def validate(self):
        def bad(name, msg):
            raise ValueError(f"config field '{name}': {msg}")

        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "save_steps", "logging_steps"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        if self.max_steps == 0 or self.max_steps < -1:
            bad("max_steps", f"must be >= 1, or -1 (num_train_epochs decides), got {self.max_steps}")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            bad("num_train_epochs", f"must be > 0 when max_steps is -1, got {self.num_train_epochs}")
        if self.max_length is not None and self.max_length < 2:
            bad("max_length", f"must be >= 2 (a token to predict from and one to predict), got {self.max_length}")
        if self.logprob_chunk_size is not None and self.logprob_chunk_size < 1:
            bad("logprob_chunk_size", f"must be >= 1 (or null), got {self.logprob_chunk_size}")
        if self.lr_scheduler_type not in ("constant", "linear", "cosine"):
            bad("lr_scheduler_type", f"{self.lr_scheduler_type!r} is not constant, linear or cosine")
        if self.optim not in ("adamw_8bit", "adamw_torch"):
            bad("optim", f"{self.optim!r} is not adamw_8bit or adamw_torch")
        if self.lora_dtype not in ("auto", "float32", "bfloat16", "float16"):
            bad("lora_dtype", f"{self.lora_dtype!r} is not auto, float32, bfloat16 or float16")
        if not self.dataset_text_field:
            bad("dataset_text_field", "must name a column")
        from ..rl.config_checks import check_inputs

        check_inputs(_Inputs(self))  # lora_r, lora_alpha, lora_dropout, device, dtype, quant: GRPOConfig's checks
        TrainConfig.validate(self)

    def steps_for(self, examples: int, world: int = 1) -> int:
        """Optimizer updates of the run: max_steps, or num_train_epochs over `examples`."""
        if self.max_steps > 0:
            return self.max_steps
        per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps * world
        return max(1, -(-int(round(self.num_train_epochs * examples)) // per_step))


@dataclass
class _Inputs:
    """The fields rl.config_checks.check_inputs reads, from an SFTConfig (no task, no evaluation)."""
    cfg: SFTConfig

    def __getattr__(self, name):
        if name in ("eval_limit", "eval_dataset_name"):
            return None
        if name == "dataset_name":
            return "arithmetic"  # SFT data is checked when it is read (sft/data.py), not as a GRPO task
        if name == "dataset_config":
            return {}
        return getattr(self.cfg, name)
