"""TRL's GRPO API over qerl: a script written for TRL runs with only its import line changed,

    from trl import GRPOConfig, GRPOTrainer        ->        from qerl.trl import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=my_reward,
                          args=GRPOConfig(output_dir="out", learning_rate=1e-5), train_dataset=rows)
    trainer.train()

`GRPOConfig(...)` takes TRL's field names (qerl's aliases: rl/config.py FIELD_ALIASES); TRL's fields that
steer only TRL's engines or logging are ignored in one line; the surface's own (max_steps in optimizer
steps, num_train_epochs, log_completions, eval_strategy, run_name, hub_model_id...) ride as `cfg.trl`
(train/trl_fields.py), and fields that would change training and that qerl lacks are refused by name.
Defaults are qerl's except dynamic_sampling (off, as TRL has none); README.md, "Coming from TRL", lists the rest.
`GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
reward_processing_classes, callbacks, peft_config, tools, environment_factory)`: model a hub id, folder
or transformers model; reward_funcs functions (sync or async, called as TRL calls them:
rl/rewards.py), reward models by id or as models (reward_models.py); datasets rows, a datasets.Dataset
or a .jsonl path; peft_config a LoraConfig or a mapping of its fields (lora.py). The Trainer surface
(surface.py), TRL's step numbering (steps.py), TRL's evaluation (grpo_eval.py) and log_completions
(completions.py) are each their own module.
"""

from __future__ import annotations

import dataclasses

from ..rl import GRPOConfig as _Config
from ..train.optim import warmup_steps
from ..rl import GRPOTrainer as _Trainer
from ..train import trl_fields
from . import steps
from .data import base_id, eval_sets, model_folder, read_rows, removes_temporary_models
from .lora import lora_change
from .surface import TrainerSurface

__all__ = ["GRPOConfig", "GRPOTrainer"]

# qerl fields whose default under qerl.trl is TRL's behaviour, not qerl's (README: defaults that differ)
TRL_DEFAULTS = {"dynamic_sampling": False}  # TRL has none: it would change the number of generations


def GRPOConfig(**kw) -> _Config:  # noqa: N802 - TRL's class name, called as a constructor
    """qerl's GRPOConfig from TRL's keyword arguments (see the module's doc); TRL's own fields that the
    surface reads (max_steps in optimizer steps, num_train_epochs, log_completions, ...) ride as `cfg.trl`."""
    trl, rest = trl_fields.split(kw, "GRPOConfig")
    for k, v in TRL_DEFAULTS.items():
        rest.setdefault(k, v)
    if trl.max_steps not in (-1, None):
        rest["max_steps"] = trl.max_steps  # provisional: the trainer turns optimizer steps into generations
    cfg = _Config(**rest)
    cfg.trl = trl
    return cfg


def _world() -> int:
    from ..train.distributed import world_size

    return world_size()  # torchrun's, checked as the trainer's Dist reads it


class GRPOTrainer(TrainerSurface, steps.TRLNumbering, _Trainer):
    """qerl's trainer with TRL's constructor and Trainer surface (see the module's doc)."""

    KIND_TAG = "grpo"
    # the parity check's seconds show in the line of a step that ran one (the first): its cost is visible
    LOG_KEYS = _Trainer.LOG_KEYS + ("time_parity",)

    @removes_temporary_models  # a model object's temporary copy: removed once built, failed or interrupted
    def __init__(self, model, reward_funcs=None, args: _Config | None = None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None,
                 **kw):
        if any(o is not None for o in optimizers):
            raise NotImplementedError("qerl.trl.GRPOTrainer: optimizers is not supported; nearest: the config's optim, "
                                      "learning_rate, lr_scheduler_type, warmup_steps")
        if rollout_func is not None:
            raise trl_fields.refuse("rollout_func", getattr(rollout_func, "__name__", rollout_func),
                                    "tools=[...] or environment_factory (qerl's engine runs the multi-turn rollout)")
        if reward_funcs is None:
            raise ValueError("reward_funcs: GRPOTrainer needs reward functions (a function, a reward model id, or a "
                             "list of them)")
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        from .reward_models import reward_callables

        funcs = reward_callables(funcs, reward_processing_classes)
        if isinstance(args, dict):  # TRL's GRPOConfig(**args)
            try:
                args = GRPOConfig(**args)
            except TypeError as e:
                raise ValueError(f"args: {e}") from None
        elif args is not None and not isinstance(args, _Config):
            raise ValueError(f"args: {type(args).__name__} is not a GRPOConfig (pass qerl.trl.GRPOConfig(...) or a "
                             "mapping of its fields)")
        args = args if args is not None else GRPOConfig()
        trl = getattr(args, "trl", None) or trl_fields.TRLArgs(max_steps=args.max_steps)
        rows = read_rows(train_dataset, "train_dataset")
        if rows is None:
            raise ValueError("train_dataset: GRPOTrainer needs the training prompts")
        self._eval_sets = eval_sets(eval_dataset)  # TRL's evaluation: each set under eval_<name>_ when named
        eval_rows = None if self._eval_sets is None else [r for rs in self._eval_sets.values() for r in rs]
        folder = model_folder(model, processing_class)
        change = {"model_name_or_path": folder}
        self._base_id = base_id(model)
        from .quantization import quant_of

        if (quant := quant_of(quantization_config)) is not None:
            change["quant"] = quant
        if peft_config is not None:
            change.update(lora_change(peft_config))
        else:  # TRL would fine-tune every weight: said as a config's use_peft: false is
            print(trl_fields.not_carried_out("peft_config", None, "GRPOTrainer"), flush=True)
        cfg = dataclasses.replace(args, **change)
        self.step_plan = plan = steps.plan(cfg, trl.max_steps, trl.num_train_epochs, len(rows), _world())
        change = {"max_steps": plan.qerl_steps}
        if trl.warmup_ratio:  # TrainingArguments': a fraction of the optimizer steps
            change["warmup_steps"] = warmup_steps(trl.warmup_ratio, plan.optimizer_steps)
        change["eval_steps"] = 0  # TRL's eval_steps are TRL's evaluation (after_step); qerl's pass@1 by its own
        if trl.eval_strategy != "no" and not eval_rows:
            raise ValueError(f"eval_strategy={trl.eval_strategy!r} needs an eval_dataset")  # as transformers
        if trl.eval_strategy != "no" and (trl.per_device_eval_batch_size * _world()) % cfg.num_generations:
            raise ValueError(f"per_device_eval_batch_size={trl.per_device_eval_batch_size}: the global eval batch "
                             f"({trl.per_device_eval_batch_size} * {_world()}) must be divisible by num_generations "
                             f"({cfg.num_generations}), as TRL's GRPOConfig requires")
        from .prompts import prompt_limit

        limit = prompt_limit(cfg, rows + (eval_rows or []), processing_class, trl.max_prompt_length)
        if limit is not None:
            change["max_prompt_length"] = limit
        cfg = dataclasses.replace(cfg, **change)
        cfg.trl = trl
        if plan.note:
            print(f"qerl: {plan.note}", flush=True)
        if rows and isinstance(rows[0]["prompt"], list):
            from ..rl.rewards import AsMessages

            funcs = [AsMessages(f) for f in funcs]
        self.trl = trl
        self._rollouts_of = {}  # step -> its rollouts, until logged (log_completions)
        super().__init__(cfg, reward_funcs=funcs, train_dataset=rows, eval_dataset=eval_rows, tools=tools,
                         environment_factory=environment_factory, callbacks=callbacks, **kw)
        self.cfg.trl = trl
        self.surface_ready()
        if folder != str(model):  # qerl's temporary copy: the run's config names what the script gave
            self.name_given_model(model, processing_class)

    # TRL's step numbering: a generation is updates_per_generation optimizer steps (steps.TRLNumbering); the
    # run loop numbers everything by them (train/loop.py global_step)

    def record(self, m: dict, log) -> None:
        super().record(m, log)
        self._log_completions(self.step - 1, log)  # the rollouts of the generation just trained on

    # ---- TRL's evaluation (grpo_eval.py); qerl's pass@1 stays, called with its MetricsLog ---------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval", **kw):
        from ..train.metrics import MetricsLog

        if isinstance(eval_dataset, MetricsLog) or "log" in kw:  # the run loop's qerl evaluation (pass@1)
            return super().evaluate(eval_dataset if eval_dataset is not None else kw["log"])
        from .grpo_eval import trl_evaluate

        sets = eval_sets(eval_dataset) if eval_dataset is not None else self._eval_sets
        if not sets:
            raise ValueError("evaluate: no eval_dataset (pass one to GRPOTrainer or to evaluate)")
        out = {}
        if self.dist.is_main:
            for name, rows in sets.items():  # TRL: a dict of eval sets logs each as eval_<name>_...
                prefix = metric_key_prefix if name is None else f"{metric_key_prefix}_{name}"
                out.update(trl_evaluate(self, rows, prefix))
        self.record_eval(out)  # as TRL's evaluate logs: log_history and on_evaluate
        return out

    def after_step(self, m: dict, log, bar) -> None:
        super().after_step(m, log, bar)
        every = self.trl.eval_steps or self.cfg.logging_steps
        if self.trl.eval_strategy == "steps" and every and self._reached(every):
            out = self.evaluate()
            if log is not None:
                log.write({"step": self.global_step, **out})
            self.dist.barrier()
            bar.unpause()

    # ---- log_completions (completions.py) --------------------------------------------------------------
    def collect_rollouts(self, ctx, inputs=None):
        ro = super().collect_rollouts(ctx, inputs)
        if self.trl.log_completions:
            self._rollouts_of[ctx.step] = ro  # (a rollout one step ahead, max_staleness 1, is another key)
        return ro

    def _reached(self, every) -> bool:
        """This generation's optimizer steps reached a multiple of `every` (TRL's eval_steps, logging_steps);
        every < 1: a fraction of the run, as transformers reads it (train/loop.py `_passed`)."""
        return self._passed(every)

    def _log_completions(self, step: int, log) -> None:
        ro = self._rollouts_of.pop(step, None)
        if ro is None or not self.dist.is_main or not self._reached(self.cfg.logging_steps or 1):
            return
        from .completions import CompletionsTable

        table = CompletionsTable.of(ro, self.tok, self.cfg.scale_rewards, self.global_step)
        table.sample(self.trl.num_completions_to_print).print()
        table.write(self.cfg.output_dir)
        table.to_trackers(getattr(log, "trackers", []), self.global_step)
