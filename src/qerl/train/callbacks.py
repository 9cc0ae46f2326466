"""TRL's `callbacks=[...]`: transformers TrainerCallback objects, called at the run loop's events.

The events, their order and their arguments are transformers' Trainer's: on_init_end, on_train_begin,
on_step_begin, on_step_end, on_log (logs=), on_save, on_evaluate (metrics=), on_train_end; each gets
(args, state, control, model=, processing_class=, optimizer=, lr_scheduler=). A callback may return a
TrainerControl: should_training_stop ends the run after the step (with a checkpoint unless save_strategy
is no), should_save writes one now. transformers' flow callback is not added: the config's own
logging_steps, save_steps and eval_steps decide (TRL's names, the same meaning).
"""

from __future__ import annotations

import inspect

from .trainer_state import TrainerControl


class Callbacks:
    def __init__(self, callbacks, args, state, **objects):
        """callbacks: TrainerCallback instances or classes (instantiated, as transformers does); args: the
        config (TRL's TrainingArguments' names); objects: model, processing_class, optimizer, lr_scheduler."""
        self.callbacks = [c() if inspect.isclass(c) else c for c in (callbacks or [])]
        self.args, self.state, self.objects = args, state, objects
        self.control = TrainerControl()

    def add(self, callback) -> None:
        self.callbacks.append(callback() if inspect.isclass(callback) else callback)

    def __call__(self, event: str, **kw) -> TrainerControl:
        if event == "on_step_begin":  # as transformers' CallbackHandler: each step starts with no request
            self.control.should_log = self.control.should_evaluate = self.control.should_save = False
        for cb in self.callbacks:
            hook = getattr(cb, event, None)
            if hook is None:
                continue
            out = hook(self.args, self.state, self.control, **self.objects, **kw)
            if out is not None:
                self.control = out
        return self.control
