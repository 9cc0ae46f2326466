"""TRL's SFT API over qerl's SFT trainer (qerl/sft):

    trainer = SFTTrainer(model="Qwen/Qwen2.5-0.5B", args=SFTConfig(output_dir="out"), train_dataset=dataset,
                         peft_config=LoraConfig(r=16, lora_alpha=32))
    trainer.train()

`SFTConfig(...)` takes TRL's field names and defaults (README: "defaults that differ" lists the rest);
TRL's fields that only steer its data pipeline or precision are ignored in one line; those that would
change training and that qerl lacks are taken at TRL's default (named in that line) and refused by name with the
nearest supported field at any other value (train/trl_fields.py). Data in TRL's
formats: `dataset_text_field` text, prompt + completion (completion_only_loss), conversations
(`messages`, assistant_only_loss), or rows made by `formatting_func`. A step is one optimizer update,
as TRL's; without max_steps it trains num_train_epochs in transformers' count of steps. The step's metrics
add TRL's `mean_token_accuracy`; eval_strategy="steps" with an eval_dataset logs `eval_loss` and
`eval_mean_token_accuracy` (and `trainer.evaluate()` returns them).
"""

from __future__ import annotations

import dataclasses
import math
import time

from ..sft import SFTConfig as _Config
from ..sft import SFTTrainer as _Trainer
from ..train.sampler import PromptSampler
from ..train import trl_fields as table  # (trl_fields: the function below)
from .data import base_id, eval_sets, model_folder, read_rows, removes_temporary_models
from .lora import lora_change
from .surface import TrainerSurface
from .token_accuracy import token_stats

__all__ = ["SFTConfig", "SFTTrainer"]

# TRL's SFTConfig defaults where qerl's own SFTConfig has another (README: defaults that differ)
TRL_DEFAULTS = {"learning_rate": 2e-5, "packing": False, "report_to": "none", "save_total_limit": None,
                "output_dir": "trainer_output"}
# TRL's SFT fields that qerl's SFTConfig lacks: train/trl_fields.py (ignored, at TRL's default, or refused by name)


def trl_fields(kw: dict, source: str = "SFTConfig", not_carried_out=()) -> tuple[table.TRLArgs, dict]:
    """(the TRL surface's fields, qerl SFTConfig's) of TRL SFTConfig fields: renamed ones mapped, ignored ones
    said in one line, those that would change training refused by name (a `trl sft --config` file too).
    not_carried_out: fields of the TRL surface (train/trl_fields.TRLArgs) that the caller does not act on; those
    given are named in the same ignored line."""
    trl, rest = table.split(kw, source)
    own = {f.name for f in dataclasses.fields(_Config)}
    if rest.pop("padding_free", False):
        rest["packing"] = True  # the same loss without padding: qerl's packing is padding-free
    rest = table.sort_out(rest, "sft", own, source, also_ignored=[k for k in kw if k in not_carried_out])
    for k in ("num_train_epochs", "max_steps"):  # TRL's meaning is qerl SFT's: optimizer steps, epochs
        if k in kw:
            rest[k] = getattr(trl, k)
    return trl, rest


def SFTConfig(**kw) -> _Config:  # noqa: N802 - TRL's class name, called as a constructor
    """qerl's SFTConfig from TRL's keyword arguments, with TRL's defaults (see the module's doc)."""
    trl, rest = trl_fields(kw)
    own = {f.name for f in dataclasses.fields(_Config)}
    unknown = sorted(k for k in rest if k not in own)
    if unknown:
        raise TypeError(f"SFTConfig: unknown field(s) {', '.join(unknown)}")
    for k, v in TRL_DEFAULTS.items():
        rest.setdefault(k, v)
    rest["num_train_epochs"] = trl.num_train_epochs
    rest["max_steps"] = trl.max_steps if trl.max_steps not in (None, 0) else -1
    cfg = _Config(**rest)
    cfg.trl = trl
    return cfg


def trl_steps(cfg, examples: int, world: int) -> int:
    """transformers' optimizer steps for num_train_epochs over `examples` (each rank's dataloader of
    per_device_train_batch_size, the last batch short; ceil over gradient_accumulation_steps)."""
    per_rank = math.ceil(examples / world)  # DistributedSampler pads to a whole share
    batches = math.ceil(per_rank / cfg.per_device_train_batch_size)
    return math.ceil(cfg.num_train_epochs * max(math.ceil(batches / cfg.gradient_accumulation_steps), 1))


class SFTTrainer(TrainerSurface, _Trainer):
    """qerl's SFT trainer with TRL's constructor and Trainer surface (see the module's doc)."""

    KIND_TAG = "sft"
    LOG_KEYS = _Trainer.LOG_KEYS + ("mean_token_accuracy",)

    @removes_temporary_models  # a model object's temporary copy: removed once built, failed or interrupted
    def __init__(self, model, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_loss_func=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None, formatting_func=None, **kw):
        for name, v, nearest in (("data_collator", data_collator, "packing / max_length"),
                                 ("compute_loss_func", compute_loss_func, "none: the loss is TRL's nll"),
                                 ("compute_metrics", compute_metrics, "eval_strategy='steps' (eval_loss, "
                                                                      "eval_mean_token_accuracy)"),
                                 ("optimizer_cls_and_kwargs", optimizer_cls_and_kwargs, "the config's optim"),
                                 ("preprocess_logits_for_metrics", preprocess_logits_for_metrics, "none")):
            if v is not None:
                raise table.refuse(name, v, nearest)
        if any(o is not None for o in optimizers):
            raise table.refuse("optimizers", optimizers, "the config's optim, learning_rate, lr_scheduler_type")
        if isinstance(args, dict):
            args = SFTConfig(**args)
        elif args is None:
            args = SFTConfig(output_dir="trainer_output")
        elif not isinstance(args, _Config):
            raise ValueError(f"args: {type(args).__name__} is not an SFTConfig (pass qerl.trl.SFTConfig(...))")
        trl = getattr(args, "trl", None) or table.TRLArgs(max_steps=args.max_steps)
        rows = read_rows(train_dataset, "train_dataset", need=None)
        if rows is None:
            raise ValueError("train_dataset: SFTTrainer needs the training examples")
        sets = eval_sets(eval_dataset, need=None)  # one set, or TRL's dict of named sets
        if formatting_func is not None:  # TRL: the function's text is the example
            rows = [{args.dataset_text_field: formatting_func(r)} for r in rows]
            sets = None if sets is None else {k: [{args.dataset_text_field: formatting_func(r)} for r in v]
                                              for k, v in sets.items()}
        if trl.eval_strategy != "no" and sets is None:
            raise ValueError(f"eval_strategy={trl.eval_strategy!r} needs an eval_dataset")  # as transformers
        folder = model_folder(model, processing_class)
        change = {"model_name_or_path": folder}
        self._base_id = base_id(model)
        from .quantization import quant_of

        if (quant := quant_of(quantization_config)) is not None:
            change["quant"] = quant
        if peft_config is not None:
            change.update(lora_change(peft_config))
        else:  # TRL would fine-tune every weight: said as a config's use_peft: false is
            print(table.not_carried_out("peft_config", None, "SFTTrainer"), flush=True)
        cfg = dataclasses.replace(args, **change)
        from ..train.distributed import world_size

        world = world_size()
        if cfg.max_steps in (-1, None):
            cfg = dataclasses.replace(cfg, max_steps=trl_steps(cfg, len(rows), world))
        cfg.trl = trl  # warmup_ratio: the trainer's, once the run's updates are known (sft/trainer.py)
        self.trl = trl
        super().__init__(cfg, train_dataset=rows, callbacks=callbacks, **kw)
        self.cfg.trl = trl
        self.eval_examples = None if sets is None else {k: self._tokenized(v) for k, v in sets.items()}
        self.surface_ready()
        if folder != str(model):  # qerl's temporary copy: the run's config names what the script gave
            self.name_given_model(model, processing_class)

    def train_step(self) -> dict:
        """qerl's step, and TRL's mean_token_accuracy on the step's examples before the update."""
        cfg, D = self.cfg, self.dist
        st = self.sampler.state()
        per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
        drawn = PromptSampler(len(self.examples), cfg.seed, st["epoch"], st["pos"]).take(per_rank * D.world)
        _, mine = D.shard(drawn)  # the examples super().train_step() draws next
        stats = token_stats(self.model, [self.examples[i] for i in mine], self.device,
                            cfg.per_device_train_batch_size, self.tok.pad_token_id or 0)
        m = super().train_step()
        correct, tokens = D.sum(stats.correct, self.device), D.sum(stats.tokens, self.device)
        m["mean_token_accuracy"] = correct / tokens if tokens else float("nan")
        return m

    def _tokenized(self, rows: list[dict]) -> list:
        from ..sft.data import Tokenizer

        cfg = self.cfg
        return Tokenizer(self.tok, text_field=cfg.dataset_text_field, max_length=cfg.max_length,
                         assistant_only_loss=cfg.assistant_only_loss, completion_only_loss=cfg.completion_only_loss,
                         source="eval_dataset")(rows).examples

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict:
        """TRL's evaluation: the eval examples' loss and token accuracy, {prefix}_loss and
        {prefix}_mean_token_accuracy (a dict of sets: {prefix}_{name}_...), and the time it took."""
        sets = self.eval_examples
        if eval_dataset is not None:
            sets = {k: self._tokenized(v) for k, v in eval_sets(eval_dataset, need=None).items()}
        if not sets:
            raise ValueError("evaluate: no eval_dataset (pass one to SFTTrainer or to evaluate)")
        out = {}
        for name, examples in sets.items():
            prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
            out.update(self._evaluate_set(examples, prefix))
        self.record_eval(out)  # as TRL's evaluate logs: log_history and on_evaluate
        return out

    def _evaluate_set(self, examples: list, p: str) -> dict:
        t0 = time.perf_counter()
        D = self.dist
        s = token_stats(self.model, examples[D.rank::D.world], self.device, self.cfg.per_device_train_batch_size,
                        self.tok.pad_token_id or 0)
        tokens = D.sum(s.tokens, self.device)
        out = {f"{p}_loss": D.sum(s.nll, self.device) / tokens if tokens else float("nan"),
               f"{p}_mean_token_accuracy": D.sum(s.correct, self.device) / tokens if tokens else float("nan"),
               f"{p}_runtime": time.perf_counter() - t0}
        out[f"{p}_samples_per_second"] = len(examples) / out[f"{p}_runtime"] if out[f"{p}_runtime"] else 0.0
        return out

    def after_step(self, m: dict, log, bar) -> None:
        super().after_step(m, log, bar)
        trl = self.trl
        every = trl.eval_steps or self.cfg.logging_steps
        if trl.eval_strategy == "steps" and self._passed(every):  # global steps; < 1: a fraction of the run
            row = {"step": self.global_step, **self.evaluate()}
            if log is not None:
                log.write(row)
            if bar is not None and hasattr(bar, "unpause"):
                bar.unpause()
