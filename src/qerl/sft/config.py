"""The supervised fine-tuning configuration: TRL's SFTConfig names where TRL has one.

The model, optimizer, run-folder, logging and memory fields are the shared ones (train/config.py,
which GRPOConfig inherits too); the data and loss fields are SFT's own. Every field carries its help text,
so `qerl sft --print_config` writes a documented YAML file and every field is a `--flag`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..train.config import TrainConfig
from ..train.fields import setting, typed


@dataclass
class SFTConfig(TrainConfig):
    """Supervised fine-tuning: the shared fields (train/config.py; SFT's own defaults redeclared below) and
    the data and loss fields."""
    TITLE = "qerl sft configuration"
    # --- SFT's defaults of shared fields (TRL's SFTConfig's where it has one) ------------------
    learning_rate: float = setting(1e-4, "Peak learning rate (LoRA takes a larger one than full fine-tuning).")
    lr_scheduler_type: str = setting("linear", "constant | linear | cosine (after warm-up).")
    adam_beta2: float = setting(0.999, "AdamW beta2.")
    optim: str = setting("adamw_torch", "adamw_torch | adamw_8bit (bitsandbytes, CUDA; falls back with a notice).")
    max_steps: int = setting(-1, "Optimizer updates (-1: as many as num_train_epochs takes).")
    per_device_train_batch_size: int = setting(8, "Examples per forward/backward micro-batch, on each rank.")
    seed: int = setting(42, "Seed of the data order and LoRA dropout.")
    output_dir: str = setting("runs/sft", "Run directory: metrics.jsonl, checkpoints, adapter, config.")
    save_total_limit: int | None = setting(2, "Keep this many checkpoints (null: all).")
    report_to: str = setting("auto", "auto (TensorBoard when installed) | none | tensorboard, wandb, trackio, mlflow "
                             "(comma-separated or a list; see GRPOConfig.report_to) | all.")
    # --- data ----------------------------------------------------------------------------------
    dataset_name: str = setting("tool_arithmetic", "A local .jsonl / .json / .parquet file, a hub dataset, or "
                                "'tool_arithmetic' (the tool task's supervised transcripts, from its training split). Rows "
                                "are TRL's formats: 'messages' (a conversation), 'text' (plain text, see "
                                "dataset_text_field) or 'prompt' + 'completion' (strings or message lists).")
    dataset_config: dict = setting({}, "Options: of the task for 'tool_arithmetic' (size, seed, ...); for a hub dataset "
                                   "`config` and `split` (default train).")
    dataset_text_field: str = setting("text", "The column holding plain text rows.")
    max_length: int | None = setting(1024, "Tokens per example; longer ones are cut at the end (TRL's keep_start; null: "
                                     "no limit).")
    packing: bool = setting(True, "Pack the examples of a micro-batch into shared rows: their common leading tokens "
                            "once, each example attending only to those and its own tokens (position ids restart, no "
                            "cross-contamination; the loss and gradients of separate rows). TRL's default is false.")
    assistant_only_loss: bool = setting(False, "Conversations: train only on the assistant turns (their content and "
                                        "end-of-turn token); system, user and tool turns are context.")
    completion_only_loss: bool | None = setting(None, "prompt + completion rows: train only on the completion (null: "
                                                "true, as TRL).")
    # --- how long ----------------------------------------------------------------------------
    num_train_epochs: float = setting(1.0, "Passes over the training examples (used when max_steps is -1).")

    STEPS_FROM_EPOCHS = True  # max_steps -1: num_train_epochs decides

    def validate(self):
        """The shared fields' checks (TrainConfig.validate), then SFT's own fields'."""
        TrainConfig.validate(self)

        def bad(name, msg):
            raise ValueError(f"config field '{name}': {msg}")

        if not math.isfinite(self.num_train_epochs):
            bad("num_train_epochs", f"must be a finite number, got {self.num_train_epochs}")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            bad("num_train_epochs", f"must be > 0 when max_steps is -1, got {self.num_train_epochs}")
        if self.max_length is not None and self.max_length < 2:
            bad("max_length", f"must be >= 2 (a token to predict from and one to predict), got {self.max_length}")
        if not self.dataset_text_field:
            bad("dataset_text_field", "must name a column")

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "SFTConfig":
        return typed(cls, trl_sorted(d, source), source)

    def steps_for(self, examples: int, world: int = 1) -> int:
        """Optimizer updates of the run: max_steps, or num_train_epochs over `examples`."""
        if self.max_steps > 0:
            return self.max_steps
        per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps * world
        return max(1, -(-int(round(self.num_train_epochs * examples)) // per_step))



def trl_sorted(d: dict, source: str) -> dict:
    """`d` less TRL's fields that SFTConfig lacks, by train/trl_fields.py's one rule, as GRPOConfig's
    (rl/config.py resolve_aliases): without an effect, or at TRL's default, named in one line; another value
    of one that would change training refused by name with the nearest field (SFTConfig(warmup_ratio=0.1) was a
    raw TypeError where GRPOConfig named warmup_steps; qerl.trl's SFTConfig takes TRL's ratio)."""
    import dataclasses

    from ..train.trl_fields import sort_out

    return sort_out(d, "sft", {f.name for f in dataclasses.fields(SFTConfig)}, source)


_dataclass_init = SFTConfig.__init__


def _init_sorted(self, *args, **kw):
    _dataclass_init(self, *args, **trl_sorted(kw, "SFTConfig"))


_init_sorted.__wrapped__ = _dataclass_init  # SFTConfig(bf16=True) as in TRL: TRL's fields by the one rule
SFTConfig.__init__ = _init_sorted
