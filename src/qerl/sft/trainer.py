"""Supervised fine-tuning of the LoRA on the frozen quantized base: `SFTTrainer(SFTConfig(...)).train()`.

Only the step is SFT's: the run around it (run folder, resume, checkpoints, metrics and trackers,
trainer.state, callbacks, the adapter) is train/loop.py's, as for GRPO. The policy loads as for `qerl
train`; each step is one call of the policy update (train/update.py: packed micro-batches, chunked
logprobs, gradient accumulation, clipping, the memory levers) on a batch of examples (sft/batch.py) whose
loss is the token-mean negative log-likelihood (sft/loss.py). The adapter it writes (output_dir/adapter) is PEFT's
format: a start for `qerl train` (an adapter folder as its model_name_or_path) and for PEFT.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..train.loop import TrainLoop
from ..train.parts import Needs, TrainParts
from ..train.sampler import PromptSampler
from ..train.optim import warmup_steps
from ..train.update import PolicyUpdate, UpdateInputs, UpdateSettings
from .batch import sft_batch
from .config import SFTConfig
from .data import Tokenizer, load_rows
from .loss import TokenNLL

KEEP = ("loss", "grad_norm", "entropy")  # of the update's metrics (the others are RL's: clipping, mismatch)


def update_settings(cfg: SFTConfig) -> UpdateSettings:
    """What the policy update reads for SFT: its batch and memory fields, one pass, temperature 1."""
    return UpdateSettings(cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps,
                          packed_update=cfg.packing, logprob_chunk_size=cfg.logprob_chunk_size)


class SFTTrainer(TrainLoop):
    """`SFTTrainer(config).train()`; or pass a built `policy` (its LoRA is trained in place) and
    `train_dataset` rows (TRL's formats: messages, text, prompt + completion) instead of dataset_name."""

    KIND = "sft"
    LOG_KEYS = ("step", "loss", "grad_norm", "lr", "epoch", "time_step")

    def __init__(self, config: SFTConfig | None = None, *, policy=None, train_dataset=None, progress: bool = True,
                 callbacks=None):
        cfg = config or SFTConfig()
        rows = list(train_dataset) if train_dataset is not None else load_rows(cfg.dataset_name, cfg.dataset_config)
        self._source = "train_dataset" if train_dataset is not None else f"dataset_name {cfg.dataset_name}"
        self._rows = rows
        # TRL's warmup_ratio, carried by qerl.trl.SFTConfig and by `qerl sft` of a `trl sft --config` file
        self._warmup_ratio = getattr(getattr(cfg, "trl", None), "warmup_ratio", 0.0) or 0.0
        parts = TrainParts.build(cfg, Needs(micro_batch_tokens=self._micro_batch_tokens,
                                            total_updates=self._total_updates, on_policy=self._tokenize),
                                 policy=policy, progress=progress, label="qerl sft")
        self.sampler = PromptSampler(len(self.examples), cfg.seed)
        ucfg = update_settings(parts.cfg)
        self.update = PolicyUpdate(UpdateInputs(parts.model, ucfg, parts.device, parts.dtype,
                                                parts.tok.pad_token_id or 0, parts.dist, parts.profiler,
                                                self.optimizer_step), TokenNLL())
        self.setup_loop(parts, callbacks)  # the run folder, trainer.state, the callbacks (train/loop.py)

    # ---- what the build asks (train/parts.py) -----------------------------------------------------
    def _tokenize(self, parts: TrainParts) -> None:
        cfg = parts.cfg
        data = Tokenizer(parts.tok, text_field=cfg.dataset_text_field, max_length=cfg.max_length,
                         assistant_only_loss=cfg.assistant_only_loss, completion_only_loss=cfg.completion_only_loss,
                         source=self._source)(self._rows)
        self.examples = data.examples
        if parts.dist.is_main and (data.truncated or data.dropped):
            print(f"qerl sft: {self._source}: {data.truncated} examples cut at max_length={cfg.max_length}, "
                  f"{data.dropped} left out (no trained token within max_length)", flush=True)

    def _micro_batch_tokens(self, parts: TrainParts) -> int:
        return parts.cfg.per_device_train_batch_size * max(len(e.ids) for e in self.examples)

    def _total_updates(self, parts: TrainParts) -> int:
        self.max_steps = parts.cfg.steps_for(len(self.examples), parts.dist.world)
        if self._warmup_ratio:  # TRL's warmup_ratio: a fraction of the updates, known only now without max_steps
            parts.cfg.warmup_steps = warmup_steps(self._warmup_ratio, self.max_steps)  # config.yaml records it
        return self.max_steps

    @property
    def max_steps(self) -> int:
        return self._max_steps

    @max_steps.setter
    def max_steps(self, n: int) -> None:
        self._max_steps = n

    # ---- one step: one optimizer update -----------------------------------------------------------
    def train_step(self) -> dict:
        cfg, D = self.cfg, self.dist
        t0 = time.perf_counter()
        per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        _, mine = D.shard(self.sampler.take(per_rank * D.world))
        examples = [self.examples[i] for i in mine]
        batch = sft_batch(examples, cfg.per_device_train_batch_size)
        lr = self.scheduler.get_last_lr()[0]
        m = self.update(batch)
        tokens = sum(sum(e.trained) for e in examples)
        # TRL's num_tokens: the trained tokens so far, all ranks
        self.state.num_input_tokens_seen += int(D.sum(tokens, self.device))
        row = {"step": self.step, **{k: m[k] for k in KEEP if k in m}, "lr": lr, "learning_rate": lr,
               "epoch": self.epoch(), "num_tokens": self.state.num_input_tokens_seen, **self.profiler.take()}
        row["time_step"] = time.perf_counter() - t0
        self.step += 1
        return row

    # ---- what the run loop asks (train/loop.py) ---------------------------------------------------
    def epoch(self) -> float:
        return (self.sampler.epoch * len(self.examples) + self.sampler.pos) / len(self.examples)

    def checkpoint_contents(self) -> tuple[dict, dict | None]:
        return {"data": self.sampler.state(), "config": self.cfg.to_dict(), "world_size": self.dist.world,
                "kind": "sft"}, None

    def restore(self, st: dict, folder: Path) -> None:
        if st.get("kind") != "sft":
            raise ValueError(f"{folder}: not an SFT checkpoint (written by `qerl train`?)")
        self.sampler = PromptSampler(len(self.examples), self.cfg.seed, st["data"]["epoch"], st["data"]["pos"])
