"""The supervised fine-tuning configuration: TRL's SFTConfig names where TRL has one.

The model, optimizer, run-folder and memory fields mean what they mean in GRPOConfig (same
names, same checks); the data and loss fields are SFT's own. Every field carries its help text,
so `qerl sft --print_config` writes a documented YAML file and every field is a `--flag`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

import yaml

from ..rl.config import _as, _f, _parse, _types, typed, yaml_mapping


@dataclass
class SFTConfig:
    # --- model (as GRPOConfig) -----------------------------------------------------------------
    model_name_or_path: str = _f("smollm2", "A folder, a hub id, or 'smollm2' (the offline default model).")
    quant: str = _f("nvfp4", "Base weight format: nvfp4 | mxfp4 | nf4 | bf16 | auto (keep a checkpoint's own).")
    lora_r: int = _f(32, "LoRA rank.")
    lora_alpha: float = _f(64.0, "LoRA alpha (scaling = alpha / r).")
    lora_dropout: float = _f(0.0, "Dropout on the LoRA input.")
    lora_target_modules: list = _f(["q", "k", "v", "o", "gate", "up", "down"], "Linears that get LoRA (and are "
                                   "quantized).", item=str)
    dtype: str = _f("auto", "Compute dtype: auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32.")
    device: str = _f("auto", "auto | cuda | cpu.")
    lora_dtype: str = _f("auto", "Dtype of the LoRA factors: auto (the compute dtype) | float32 | bfloat16 | float16 "
                         "(as GRPOConfig.lora_dtype).")
    trust_remote_code: bool = _f(False, "Run a hub model's own code (off unless you ask).")
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
    # --- optimisation (as GRPOConfig; a step is one optimizer update, as in TRL) ----------------
    learning_rate: float = _f(1e-4, "Peak learning rate (LoRA takes a larger one than full fine-tuning).")
    lr_scheduler_type: str = _f("linear", "constant | linear | cosine (after warm-up).")
    warmup_steps: int = _f(0, "Optimizer updates of linear warm-up.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_beta1: float = _f(0.9, "AdamW beta1.")
    adam_beta2: float = _f(0.999, "AdamW beta2.")
    adam_epsilon: float = _f(1e-8, "AdamW epsilon.")
    max_grad_norm: float = _f(1.0, "Gradient clipping norm (0: off).")
    optim: str = _f("adamw_torch", "adamw_torch | adamw_8bit (bitsandbytes, CUDA; falls back with a notice).")
    num_train_epochs: float = _f(1.0, "Passes over the training examples (used when max_steps is -1).")
    max_steps: int = _f(-1, "Optimizer updates (-1: as many as num_train_epochs takes).")
    per_device_train_batch_size: int = _f(8, "Examples per forward/backward micro-batch, on each rank.")
    gradient_accumulation_steps: int = _f(1, "Micro-batches per optimizer update.")
    gradient_checkpointing: bool | None = _f(None, "Recompute activations in backward (null: on only when the "
                                             "activations would not fit in the free memory, chosen and printed).")
    logprob_chunk_size: int | None = _f(None, "Tokens per chunk of the lm_head and log-softmax (null: chosen from "
                                        "the free memory).")
    seed: int = _f(42, "Seed of the data order and LoRA dropout.")
    # --- run (as GRPOConfig) -------------------------------------------------------------------
    output_dir: str = _f("runs/sft", "Run directory: metrics.jsonl, checkpoints, adapter, config.")
    overwrite_output_dir: bool = _f(False, "Start afresh in an output_dir that holds an earlier run, deleting it "
                                    "(without it, or --resume, such a folder is refused).")
    logging_steps: int = _f(10, "Print a metrics line every N steps (metrics.jsonl gets every step).")
    save_steps: int = _f(500, "Checkpoint every N steps (and at the end).")
    save_total_limit: int | None = _f(2, "Keep this many checkpoints (null: all).")
    report_to: str = _f("auto", "auto (TensorBoard when installed) | tensorboard | none.")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(f, getattr(self, f.name), "config"))
        self.validate()

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

    def steps_for(self, examples: int, world: int = 1) -> int:
        """Optimizer updates of the run: max_steps, or num_train_epochs over `examples`."""
        if self.max_steps > 0:
            return self.max_steps
        per_step = self.per_device_train_batch_size * self.gradient_accumulation_steps * world
        return max(1, -(-int(round(self.num_train_epochs * examples)) // per_step))

    # ---- files and command lines (GRPOConfig's forms) ------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "SFTConfig":
        return typed(cls, d, source, coerce)

    @classmethod
    def from_yaml(cls, path) -> "SFTConfig":
        return cls.from_dict(yaml_mapping(path), source=str(path))

    def with_overrides(self, pairs: dict[str, str]) -> "SFTConfig":
        """CLI overrides by field name; values parse as YAML scalars."""
        d = self.to_dict()
        for k, v in pairs.items():
            d[k] = _parse(k, v, type(self))
        return type(self).from_dict(d, source="command line")

    def to_yaml(self, documented: bool = True) -> str:
        lines = ["# qerl sft configuration (every field, with its default and meaning)"] if documented else []
        for f in dataclasses.fields(self):
            if documented:
                lines.append(f"# {f.metadata.get('help', '')}")
            lines.append(yaml.safe_dump({f.name: getattr(self, f.name)}, default_flow_style=True, width=1000).strip()
                         .removeprefix("{").removesuffix("}"))
        return "\n".join(lines) + "\n"


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


_HINTS: dict = {}


def coerce(f: dataclasses.Field, value, source: str):
    """rl.config.coerce for SFTConfig's fields: `value` as the field's type, or a ValueError naming it."""
    if not _HINTS:
        _HINTS.update(typing.get_type_hints(SFTConfig))
    types = _types(_HINTS[f.name])
    if value is None and type(None) in types:
        return None
    label = f"--{f.name}" if source == "command line" else f"field '{f.name}'"
    want = next(t for t in types if t is not type(None))
    try:
        out = _as(want, value)
        if want is list and f.metadata.get("item") is not None:
            out = [_as(f.metadata["item"], x) for x in out]
        return out
    except (TypeError, ValueError) as e:
        null = " or null" if type(None) in types else ""
        raise ValueError(f"{source}: {label}: {value!r} is not {e}{null}") from None
