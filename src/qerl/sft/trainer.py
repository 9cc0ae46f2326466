"""Supervised fine-tuning of the LoRA on the frozen quantized base: `SFTTrainer(SFTConfig(...)).train()`.

The same pieces as the RL trainer, not a second training loop: the policy loads as for `qerl
train`; each step is one call of the policy update (rl/update.py: packed micro-batches, chunked
logprobs, gradient accumulation, clipping, the memory levers) on a batch of examples whose loss
is the negative log-likelihood (sft/batch.py says how); checkpoints, resume, the run folder's
lock, metrics and the adapter are rl/state.py's, rl/run_folder.py's and rl/metrics.py's. The
adapter it writes (output_dir/adapter) is PEFT's format: a start for `qerl train` (an adapter
folder as its model_name_or_path) and for PEFT.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..rl import levers, run_folder
from ..rl import state as ckpt
from ..rl.config import GRPOConfig
from ..rl.distributed import Dist
from ..rl.metrics import MetricsLog
from ..rl.optim import lr_lambda, make_optimizer
from ..rl.profiling import Profiler
from ..rl.sampler import PromptSampler
from ..rl.trainer import resolve_device_dtype, set_lora_dtype
from ..rl.update import PolicyUpdate, UpdateInputs, step_optimizer
from .batch import sft_batch
from .config import SFTConfig
from .data import Tokenizer, load_rows

KEEP = ("loss", "grad_norm", "entropy")  # of the update's metrics (the others are RL's: clipping, mismatch)


def update_settings(cfg: SFTConfig) -> GRPOConfig:
    """The GRPOConfig the policy update reads: SFT's batch, optimizer and memory fields, and the loss
    settings under which the policy loss is the NLL (sft/batch.py): cispo with its weight capped at 1,
    one pass, no KL, no entropy terms, no noise, temperature 1."""
    same = ("model_name_or_path", "quant", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "dtype",
            "device", "lora_dtype", "trust_remote_code", "learning_rate", "lr_scheduler_type", "warmup_steps",
            "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm", "optim",
            "per_device_train_batch_size", "gradient_accumulation_steps", "gradient_checkpointing",
            "logprob_chunk_size", "seed", "output_dir")
    return GRPOConfig(**{k: getattr(cfg, k) for k in same}, packed_update=cfg.packing, loss_type="cispo",
                      epsilon_high=1.0, num_iterations=1, beta=0.0, temperature=1.0, entropy_coeff=0.0,
                      top_entropy_quantile=1.0, importance_sampling_correction=False, aqn=False,
                      aqn_in_training=False, mask_truncated_completions=False, generation_batch_size=None,
                      steps_per_generation=2 * cfg.gradient_accumulation_steps, num_generations=2,
                      parity_check_steps=0)


class SFTTrainer:
    """`SFTTrainer(config).train()`; or pass a built `policy` (its LoRA is trained in place) and
    `train_dataset` rows (TRL's formats: messages, text, prompt + completion) instead of dataset_name."""

    def __init__(self, config: SFTConfig | None = None, *, policy=None, train_dataset=None, progress: bool = True):
        self.cfg = cfg = config or SFTConfig()
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        self.device, self.dtype = resolve_device_dtype(cfg)
        self.dist = Dist.from_env(self.device.type)
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
        if self.levers.chosen:
            self.update_cfg = ucfg = dataclasses.replace(ucfg, gradient_checkpointing=self.levers.gradient_checkpointing,
                                                         logprob_chunk_size=self.levers.logprob_chunk_size)
            if self.dist.is_main and progress:
                print(f"qerl sft: {self.levers.describe()}", flush=True)
        if ucfg.gradient_checkpointing:
            kw = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        self.max_steps = cfg.steps_for(len(self.examples), self.dist.world)
        self.optimizer, self.optim_name = make_optimizer(ucfg, self.params, self.device, self.master_weights)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(ucfg, self.max_steps))
        self.sampler = PromptSampler(len(self.examples), cfg.seed)
        self.step = 0
        self.progress = progress
        self.out = Path(cfg.output_dir)
        self._resumed_from = None
        self._lock = run_folder.RunLock(self.out) if self.dist.is_main else None
        self.profiler = Profiler()
        self.update = PolicyUpdate(UpdateInputs(self.model, ucfg, self.device, self.dtype, self.tok.pad_token_id or 0,
                                                self.dist, self.profiler, None, self.optimizer_step))

    # ---- what PolicyUpdate asks of a trainer ----------------------------------------------------
    def optimizer_step(self, bad: str | None) -> float:
        """Apply one update's gradients, as GRPOTrainer does (update.step_optimizer)."""
        return step_optimizer(self.params, self.optimizer, self.scheduler, self.dist, self.device,
                              self.cfg.max_grad_norm, bad, self.bad_step)

    def bad_step(self, what: str) -> str:
        last = ckpt.checkpoints(self.out)
        keep = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
        return f"sft step {self.step}: {what}; the step's update was not applied and training stops ({keep})"

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
        row = {"step": self.step, **{k: m[k] for k in KEEP if k in m}, "lr": lr,
               "epoch": (self.sampler.epoch * len(self.examples) + self.sampler.pos) / len(self.examples),
               "num_tokens": int(D.sum(tokens, self.device)), **self.profiler.take()}
        row["time_step"] = time.perf_counter() - t0
        self.step += 1
        return row

    # ---- checkpoints and the run folder (as GRPOTrainer's) -------------------------------------------
    def save(self) -> Path | None:
        path = None
        if self.dist.is_main:
            extra = {"data": self.sampler.state(), "config": self.cfg.to_dict(), "world_size": self.dist.world,
                     "kind": "sft"}
            path = ckpt.save_checkpoint(self.out, self.step, self.model, self.optimizer, self.scheduler, extra,
                                        base_name=self.cfg.model_name_or_path, keep=self.cfg.save_total_limit)
        self.dist.barrier()
        return path

    def _claim(self, fresh: bool) -> None:
        if self._lock is None:
            return
        self._lock.acquire()
        try:
            run_folder.clean_temporaries(self.out)
            if fresh:
                run_folder.refuse_or_clear(self.out, self.cfg.overwrite_output_dir)
        except BaseException:
            self._lock.release()
            raise

    def resume(self, folder=None) -> int:
        """Continue from `folder`, or the run directory's newest complete checkpoint. Returns the step."""
        self._claim(fresh=False)
        try:
            if folder is None:
                found = ckpt.checkpoints(self.out)
                if not found:
                    raise FileNotFoundError(f"{self.out}: no checkpoint to resume from")
                folder = found[-1]
            st = ckpt.load_checkpoint(folder, self.model, self.optimizer, self.scheduler)
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise
        if st.get("kind") != "sft":
            raise ValueError(f"{folder}: not an SFT checkpoint (written by `qerl train`?)")
        self.step = st["step"]
        self.sampler = PromptSampler(len(self.examples), self.cfg.seed, st["data"]["epoch"], st["data"]["pos"])
        self._resumed_from = Path(folder)
        return self.step

    # ---- the run ------------------------------------------------------------------------------------
    def train(self, stop_after: int | None = None) -> list[dict]:
        """Run to max_steps (or stop after `stop_after` more steps, with a checkpoint at the stop);
        returns the metrics rows of this run. The adapter lands in output_dir/adapter."""
        if self._lock is None or not self._lock.held:
            self._claim(fresh=self._resumed_from is None and self.step == 0)
        try:
            return self._train(stop_after)
        finally:
            if self._lock is not None:
                self._lock.release()

    def _train(self, stop_after: int | None) -> list[dict]:
        cfg, main = self.cfg, self.dist.is_main
        end = self.max_steps if stop_after is None else min(self.max_steps, self.step + stop_after)
        log = None
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(cfg.to_yaml())
            continuing = self._resumed_from is not None or self.step > 0
            log = MetricsLog(self.out, cfg.report_to, resume_step=self.step if continuing else None)
        rows = []
        bar = tqdm(total=self.max_steps, initial=self.step, desc="sft", unit="step",
                   disable=not (self.progress and main))
        from ..kernels import dispatch

        # on the CPU the frozen weights' dequantized copies are kept for the run (as GRPOTrainer does)
        cache = dispatch.dequantized_cache() if self.device.type == "cpu" else contextlib.nullcontext()
        try:
            with cache:
                while self.step < end:
                    m = self.train_step()
                    if log is not None:
                        log.write(m)
                    rows.append(m)
                    bar.update(1)
                    bar.set_postfix(loss=f"{m.get('loss', float('nan')):.3f}")
                    if main and not self.progress and m["step"] % cfg.logging_steps == 0:
                        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()
                                       if k in ("step", "loss", "grad_norm", "lr", "epoch", "time_step")), flush=True)
                    if self.step % cfg.save_steps == 0 or self.step == end:
                        self.save()
        finally:
            bar.close()
            if log is not None:
                log.close()
        from ..checkpoint.peft_adapter import save_adapter

        if main:
            save_adapter(self.model, self.out / "adapter", base_model_name_or_path=cfg.model_name_or_path,
                         checksums=True)
            # with the tokenizer, as TRL saves it: the folder is then a model to start `qerl train` from
            self.tok.save_pretrained(self.out / "adapter")
            from ..checkpoint.checksums import write_checksums

            write_checksums(self.out / "adapter")  # last, over every file (load_adapter verifies them)
        self.dist.barrier()
        return rows
