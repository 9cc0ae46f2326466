"""Supervised fine-tuning of the LoRA on the frozen quantized base: `SFTTrainer(SFTConfig(...)).train()`.

Only the step is SFT's: the run around it (run folder, resume, checkpoints, metrics and trackers,
trainer.state, callbacks, the adapter) is train/loop.py's, as for GRPO. The policy loads as for `qerl
train`; each step is one call of the policy update (rl/update.py: packed micro-batches, chunked
logprobs, gradient accumulation, clipping, the memory levers) on a batch of examples whose loss is the
negative log-likelihood (sft/batch.py says how). The adapter it writes (output_dir/adapter) is PEFT's
format: a start for `qerl train` (an adapter folder as its model_name_or_path) and for PEFT.
"""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import torch

from ..rl.loss import LossSettings
from ..rl.trainer import resolve_device_dtype, set_lora_dtype
from ..rl.update import PolicyUpdate, UpdateInputs, UpdateSettings
from ..train import levers
from ..train.distributed import Dist
from ..train.loop import TrainLoop
from ..train.optim import lr_lambda, make_optimizer
from ..train.profiling import Profiler
from ..train.sampler import PromptSampler
from .batch import sft_batch
from .config import SFTConfig
from .data import Tokenizer, load_rows

KEEP = ("loss", "grad_norm", "entropy")  # of the update's metrics (the others are RL's: clipping, mismatch)


def update_settings(cfg: SFTConfig) -> UpdateSettings:
    """What the policy update reads for SFT: its batch and memory fields, one pass, temperature 1, and the
    loss settings under which the policy loss is the NLL (LossSettings.nll, sft/batch.py)."""
    return UpdateSettings(LossSettings.nll(), cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps,
                          packed_update=cfg.packing, logprob_chunk_size=cfg.logprob_chunk_size)


class SFTTrainer(TrainLoop):
    """`SFTTrainer(config).train()`; or pass a built `policy` (its LoRA is trained in place) and
    `train_dataset` rows (TRL's formats: messages, text, prompt + completion) instead of dataset_name."""

    KIND = "sft"
    LOG_KEYS = ("step", "loss", "grad_norm", "lr", "epoch", "time_step")

    def __init__(self, config: SFTConfig | None = None, *, policy=None, train_dataset=None, progress: bool = True,
                 callbacks=None):
        self.cfg = cfg = config or SFTConfig()
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.device, self.dtype = resolve_device_dtype(cfg)
        self.dist = Dist.from_env(self.device.type, cfg.ddp_timeout, cfg.ddp_backend)
        if self.dist.world > 1 and self.device.type == "cuda":
            self.device = torch.device("cuda", self.dist.local_rank)
        rows = list(train_dataset) if train_dataset is not None else load_rows(cfg.dataset_name, cfg.dataset_config)
        if policy is None:
            from ..model import load_policy

            policy = load_policy(cfg.model_name_or_path, cfg.quant, lora_rank=cfg.lora_r, lora_alpha=cfg.lora_alpha,
                                 lora_dropout=cfg.lora_dropout, target_modules=cfg.lora_target_modules,
                                 device=self.device, dtype=self.dtype, trust_remote_code=cfg.trust_remote_code,
                                 progress=progress)
        self.policy, self.model, self.tok = policy, policy.model, policy.tokenizer
        if self.tok is None:
            raise ValueError("the policy has no tokenizer: SFT rows are text")
        source = "train_dataset" if train_dataset is not None else f"dataset_name {cfg.dataset_name}"
        data = Tokenizer(self.tok, text_field=cfg.dataset_text_field, max_length=cfg.max_length,
                         assistant_only_loss=cfg.assistant_only_loss, completion_only_loss=cfg.completion_only_loss,
                         source=source)(rows)
        self.examples = data.examples
        if self.dist.is_main and (data.truncated or data.dropped):
            print(f"qerl sft: {source}: {data.truncated} examples cut at max_length={cfg.max_length}, {data.dropped} "
                  "left out (no trained token within max_length)", flush=True)
        self.update_cfg = ucfg = update_settings(cfg)
        self.master_weights = False
        if cfg.lora_dtype != "auto":
            want = getattr(torch, cfg.lora_dtype)
            if self.device.type == "cuda" and want == torch.float32 and self.dtype != torch.float32:
                self.master_weights = True
            else:
                set_lora_dtype(self.model, want, self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("nothing to train: the policy has no LoRA (lora_r = 0)")
        self.dist.broadcast_(self.params)
        longest = max(len(e.ids) for e in self.examples)
        self.levers = levers.choose(levers.Shape.of(self.model.config), cfg.per_device_train_batch_size * longest,
                                    levers.free_memory(self.device), gradient_checkpointing=cfg.gradient_checkpointing,
                                    logprob_chunk_size=cfg.logprob_chunk_size)
        checkpointing = cfg.gradient_checkpointing
        if self.levers.chosen:
            checkpointing = self.levers.gradient_checkpointing
            self.update_cfg = ucfg = dataclasses.replace(ucfg, logprob_chunk_size=self.levers.logprob_chunk_size)
            if self.dist.is_main and progress:
                print(f"qerl sft: {self.levers.describe()}", flush=True)
        if checkpointing:
            levers.enable_gradient_checkpointing(self.model)
        self.max_steps = cfg.steps_for(len(self.examples), self.dist.world)
        self.optimizer, self.optim_name = make_optimizer(cfg, self.params, self.device, self.master_weights)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg, self.max_steps))
        self.sampler = PromptSampler(len(self.examples), cfg.seed)
        self.progress = progress
        self.profiler = Profiler()
        self.update = PolicyUpdate(UpdateInputs(self.model, ucfg, self.device, self.dtype, self.tok.pad_token_id or 0,
                                                self.dist, self.profiler, None, self.optimizer_step))
        self.setup_loop(callbacks)  # the run folder, trainer.state, the callbacks (train/loop.py)

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
        m = self.update(batch, 0.0, 0)
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
