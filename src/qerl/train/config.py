"""The fields every qerl trainer shares: model, optimizer, run folder, logging and ranks (TRL's names).

`GRPOConfig` (rl/config.py) and `SFTConfig` (sft/config.py) inherit them, as TRL's configs share
transformers' TrainingArguments; a subclass redeclares a field only to give it another default. Every
check of a shared field runs here (train/checks.py); each subclass adds only its own in `validate`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass

import yaml

from . import checks
from .fields import coerce, parse_value, setting, typed, yaml_mapping

SAVE_STRATEGIES = ("steps", "no")
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")  # report_to's trackers (train/trackers.py)
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


@dataclass
class TrainConfig:
    # --- model -------------------------------------------------------------------------------
    model_name_or_path: str = setting("smollm2", "A folder, a hub id, or 'smollm2' (the offline default model).")
    quant: str = setting("nvfp4", "Base weight format: nvfp4 | mxfp4 | nf4 | bf16 | auto (keep a checkpoint's own).")
    lora_r: int = setting(32, "LoRA rank (the paper: 32; 16 is about as good).")
    lora_alpha: float = setting(64.0, "LoRA alpha (scaling = alpha / r).")
    lora_dropout: float = setting(0.0, "Dropout on the LoRA input during the update passes.")
    lora_target_modules: list = setting(["q", "k", "v", "o", "gate", "up", "down"], "Linears that get LoRA (and are quantized).",
                                        item=str)
    dtype: str = setting("auto", "Compute dtype: auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32.")
    device: str = setting("auto", "auto | cuda | cpu.")
    lora_dtype: str = setting("auto", "Dtype of the LoRA factors (and so of their optimizer steps): auto (the compute dtype) | "
                              "float32 (as PEFT keeps adapters by default: in bf16 an Adam step much smaller than 1/256 of a "
                              "weight rounds away; on a GPU the factors stay in the compute dtype, which the kernels read, "
                              "and the optimizer steps fp32 master copies of them) | bfloat16 | float16.")
    trust_remote_code: bool = setting(False, "Run a hub model's own code (off unless you ask).")
    modules_to_not_convert: list | None = setting(None, "Linears kept in bf16 (not quantized; still LoRA-trained), as "
                                                  "transformers' quantization configs name them: a name matches a module "
                                                  "path or its end (lm_head, layers.27.mlp.down_proj), 're:' starts a "
                                                  "regex (llm-compressor's ignore). A compressed-tensors checkpoint's "
                                                  "own ignore list is always kept. null: none.", item=str)
    lm_head_4bit: bool = setting(False, "Store the frozen lm_head in NVFP4 too (rollouts read a quarter of its bytes; a "
                                        "7B decode step at batch 1 spends ~10 % in the bf16 head). Off: the head "
                                        "stays in the model's dtype, as the paper keeps it.")
    embed_4bit: bool = setting(False, "Store the frozen input embedding in NVFP4 (a lookup dequantizes its rows): "
                                      "saves 3/4 of the table, 0.8 GiB on gpt-oss-20b, at the cost of its 4-bit "
                                      "rounding on every input. A model with a tied head is refused. Off: the "
                                      "table stays in the model's dtype.")
    # --- optimisation ------------------------------------------------------------------------
    learning_rate: float = setting(1e-5, "Peak learning rate (the paper: 1e-5 for 4-bit LoRA, 5e-6 for bf16 LoRA).")
    lr_scheduler_type: str = setting("constant", "constant | linear | cosine (after warm-up).")
    warmup_steps: int = setting(0, "Optimizer updates of linear warm-up.")
    weight_decay: float = setting(0.0, "AdamW weight decay.")
    adam_beta1: float = setting(0.9, "AdamW beta1.")
    adam_beta2: float = setting(0.99, "AdamW beta2.")
    adam_epsilon: float = setting(1e-8, "AdamW epsilon.")
    max_grad_norm: float = setting(1.0, "Gradient clipping norm (0: off).")
    optim: str = setting("adamw_8bit", "adamw_8bit (bitsandbytes, CUDA; falls back to adamw_torch with a notice) | adamw_torch.")
    max_steps: int = setting(100, "Training steps; a step is one rollout round and its num_iterations policy updates.")
    per_device_train_batch_size: int = setting(8, "Completions per forward/backward micro-batch, on each rank.")
    gradient_accumulation_steps: int = setting(1, "Micro-batches per optimizer update.")
    gradient_checkpointing: bool | None = setting(None, "Recompute activations in backward (less memory, ~30% more time; "
                                                  "null: on only when the update's activations would not fit in the "
                                                  "free memory, chosen and printed at start).")
    logprob_chunk_size: int | None = setting(None, "Tokens per chunk when computing log-probabilities and entropies (null: "
                                             "the largest of 256..8192 whose fp32 logits take <= 5% of the free memory).")
    seed: int = setting(42, "Seed of data order, rollouts and noise.")
    # --- run ---------------------------------------------------------------------------------
    output_dir: str = setting("runs/qerl", "Run directory: metrics.jsonl, checkpoints, adapter, config (its paths "
                              "recorded absolute, `~` expanded; a linked folder is written through).")
    overwrite_output_dir: bool = setting(False, "Start afresh in an output_dir that holds an earlier run, deleting that run's "
                                         "checkpoints, metrics, evaluations and adapter (without it, or --resume, such a "
                                         "folder is refused; never a folder that is, holds or lies inside the run's own "
                                         "model, adapter or data).")
    logging_steps: int = setting(10, "Print a metrics line every N steps (metrics.jsonl gets every step).")
    save_strategy: str = setting("steps", "steps (a checkpoint every save_steps steps and at the end) | no (no checkpoint; "
                                 "the final adapter is still written, and the run cannot be resumed). TRL's field.",
                                 choices=SAVE_STRATEGIES)
    save_steps: int = setting(500, "Checkpoint every N steps (and at the end).")
    save_total_limit: int | None = setting(None, "Keep this many checkpoints (null: all).")
    report_to: str = setting("none", "Trackers besides metrics.jsonl (always written), comma-separated or a list: "
                             "tensorboard | wandb | trackio | mlflow (each its own package, e.g. pip install "
                             "'qerl[wandb]'; offline: wandb's WANDB_MODE=offline, trackio's local store, mlflow's file "
                             "store under output_dir unless MLFLOW_TRACKING_URI says otherwise) | all (those installed) | "
                             "none (TRL's default) | auto (TensorBoard when installed).")
    run_name: str | None = setting(None, "The trackers' name of the run (transformers' run_name; null: the "
                                   "output folder's name).")
    # --- several GPUs / processes (torchrun) -------------------------------------------------
    ddp_timeout: int = setting(1800, "Seconds a collective waits for the other ranks before the job fails (a dead or hung rank).")
    ddp_backend: str | None = setting(None, "torch.distributed backend (null: nccl on GPUs, gloo on the CPU).")

    def __post_init__(self):
        if isinstance(self.report_to, (list, tuple)):  # TRL's report_to=["wandb", "trackio"]
            self.report_to = ",".join(self.report_to) or "none"
        for f in dataclasses.fields(self):  # Config(max_steps="6") as well as files and flags
            setattr(self, f.name, coerce(f, getattr(self, f.name), "config"))
        self.validate()

    # SFT's max_steps -1 means "as many as num_train_epochs takes"; GRPO has no epochs
    STEPS_FROM_EPOCHS = False

    def validate(self):
        """Every check of a shared field (train/checks.py); a subclass calls this first from its own validate,
        then checks its own fields."""
        checks.shared(self)
        if self.STEPS_FROM_EPOCHS:
            if self.max_steps == 0 or self.max_steps < -1:
                checks.bad("max_steps", f"must be >= 1, or -1 (num_train_epochs decides), got {self.max_steps}")
        else:
            checks.at_least(self, "max_steps", 1)
        trackers(self.report_to)  # names a tracker that is unknown or not installed

    # ---- files and command lines -----------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config"):
        return typed(cls, d, source)

    @classmethod
    def from_yaml(cls, path):
        return cls.from_dict(yaml_mapping(path), source=str(path))

    def with_overrides(self, pairs: dict[str, str]):
        """CLI overrides by field name; values parse as YAML scalars (1e-5, true, null, [q, v])."""
        d = self.to_dict()
        for k, v in pairs.items():
            d[k] = parse_value(k, v, type(self))
        return type(self).from_dict(d, source="command line")

    TITLE = "qerl training configuration"

    def to_yaml(self, documented: bool = True) -> str:
        lines = [f"# {self.TITLE} (every field, with its default and meaning)"] if documented else []
        for f in dataclasses.fields(self):
            if documented:
                lines.append(f"# {f.metadata.get('help', '')}")
            lines.append(yaml.safe_dump({f.name: getattr(self, f.name)}, default_flow_style=True, width=1000).strip()
                         .removeprefix("{").removesuffix("}"))
        return "\n".join(lines) + "\n"


def trackers(report_to: str) -> list[str]:
    """The trackers `report_to` names (besides metrics.jsonl); an unknown or uninstalled one is an error."""
    names = list(dict.fromkeys(s.strip() for s in str(report_to).split(",") if s.strip()))
    installed = [t for t in TRACKERS if importlib.util.find_spec(TRACKER_PACKAGES[t]) is not None]
    if names in ([], ["none"]):
        return []
    alone = [n for n in names if n in ("none", "all", "auto")]
    if alone and len(names) > 1:  # transformers refuses "none" beside a tracker too: which one was meant?
        raise ValueError(f"config field 'report_to': {alone[0]!r} stands alone, got {','.join(names)!r}; give "
                         f"{alone[0]} by itself, or only the trackers ({', '.join(TRACKERS)})")
    if names == ["auto"]:
        return ["tensorboard"] if "tensorboard" in installed else []
    if names == ["all"]:
        return installed
    for n in names:
        if n not in TRACKERS:
            raise ValueError(f"config field 'report_to': {n!r} is not one of {', '.join(TRACKERS)}, all, auto or none "
                             "(metrics.jsonl has every step)")
        if n not in installed:
            raise ValueError(f"config field 'report_to': {n} needs the {TRACKER_PACKAGES[n]} package "
                             f"(pip install 'qerl[{n}]')")
    return list(dict.fromkeys(names))
