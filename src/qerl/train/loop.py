"""The run around the steps, one for GRPO and SFT: claim the run folder, resume (past a corrupt checkpoint),
run the steps, log them, checkpoint, stop on request, write the adapter and the summary.

A trainer builds its parts (train/parts.py: `TrainParts.build`) and hands them to `setup_loop`; it
subclasses `TrainLoop` and says what differs: what a step does (`train_step`), how many steps
(`max_steps`), what its checkpoints carry besides the adapter, optimizer and scheduler
(`checkpoint_contents`, `restore`), and, for GRPO, what runs before, after and beside the steps
(evaluations, the rollout in flight). Everything else, and its order, is here:

    claim -> [eval on start] -> per step: on_step_begin, train_step, metrics.jsonl + trackers,
    trainer.state + log_history, on_step_end, on_log, checkpoint (save_strategy, save_steps, the last
    step, a callback's request), [evaluation] -> adapter -> summary entry, on_train_end -> release.

Steps are numbered one way everywhere (printed lines, metrics.jsonl, trainer.state, log_history, the
bar, checkpoint-N folders): TRL's global_step, optimizer steps so far, 1 after the first (`global_step`;
a trainer whose step makes several of TRL's optimizer steps says how many, `global_steps_per_step`).
logging_steps and save_steps count global steps too, as transformers': a step that passes a multiple
without landing on it logs / saves then.

Rank 0 writes files and logs; every rank runs the steps and meets at the barriers.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..device_memory import release_host_memory
from . import checkpoints as ckpt
from . import run_folder
from .callbacks import Callbacks
from .eta import RunClock
from .metrics import MetricsLog, read_rows
from .optim import step_optimizer
from .parts import TrainParts
from .trainer_state import log_entry, new_state, summary_entry
from .trl_fields import in_memory_note


class TrainLoop:
    KIND = "train"   # the progress bar's name and the messages' word
    LOG_KEYS: tuple = ("step", "loss", "grad_norm", "time_step")  # the metrics of a printed line

    # ---- what a trainer says -------------------------------------------------------------------
    @property
    def max_steps(self) -> int:
        return self.cfg.max_steps

    def train_step(self) -> dict:
        raise NotImplementedError

    def checkpoint_contents(self) -> tuple[dict, dict | None]:
        """(the state file's extra entries, extra tensor files) of a checkpoint written now."""
        raise NotImplementedError

    def check_checkpoint(self, folder: Path) -> None:
        """Refuse a checkpoint before anything is loaded from it (raise CorruptCheckpoint to skip it)."""

    def restore(self, st: dict, folder: Path) -> None:
        """Take a loaded checkpoint's own state (its data position, ...); the step is set by the loop."""
        raise NotImplementedError

    def base_name(self) -> str:
        return self.cfg.model_name_or_path

    @property
    def global_steps_per_step(self) -> int:
        """TRL's optimizer steps in one of this trainer's steps (the TRL surface's GRPO: a generation's)."""
        return 1

    @property
    def global_step(self) -> int:
        """TRL's global_step: optimizer steps so far."""
        return self.step * self.global_steps_per_step

    @property
    def global_max_steps(self) -> int:
        return self.max_steps * self.global_steps_per_step

    def run_name(self) -> str | None:
        """The trackers' name of the run: the config's run_name, else the output folder's (the TRL surface:
        run_name, else none, as transformers)."""
        return self.cfg.run_name or self.out.resolve().name

    def epoch(self) -> float | None:
        """Passes over the training rows so far (trainer.state.epoch)."""
        return None

    def postfix(self, m: dict) -> dict:
        return {"loss": f"{m.get('loss', float('nan')):.3f}"}

    def scope(self):
        """What the whole run and each bare train_step run under (GRPO: its kernel settings)."""
        return contextlib.nullcontext()

    def before_steps(self, log) -> None:
        """Run once before the steps (GRPO: the start evaluation)."""

    def after_step(self, m: dict, log, bar) -> None:
        """Run after each step's checkpoint (GRPO: the evaluations)."""

    def occasional_costs(self) -> dict:
        """time_<name> of a step row -> (steps done -> how many more times it comes): costs that are not
        every step's, for the time-left estimate (train/eta.py). GRPO: the parity check."""
        return {}

    def stop_background(self) -> None:
        """Leave nothing running when train() returns (GRPO: a rollout in flight)."""

    # ---- set up ----------------------------------------------------------------------------------
    def setup_loop(self, parts: TrainParts, callbacks=None) -> None:
        """Take the built parts (train/parts.py: config, device, ranks, policy, parameters, optimizer,
        schedule, profiler) and set up the run folder, trainer.state and the callbacks. The trainer has
        its `max_steps`, sampler and `train_step` by now."""
        self.parts = parts
        self.cfg, self.device, self.dtype, self.dist = parts.cfg, parts.device, parts.dtype, parts.dist
        self.policy, self.model, self.tok = parts.policy, parts.model, parts.tok
        self.params, self.master_weights, self.levers = parts.params, parts.master_weights, parts.levers
        self.optimizer, self.optim_name, self.scheduler = parts.optimizer, parts.optim_name, parts.scheduler
        self.profiler, self.progress = parts.profiler, parts.progress
        cfg = self.cfg
        self.step = 0
        self.out = Path(cfg.output_dir)
        self._resumed_from = None
        self._lock = run_folder.RunLock(self.out) if self.dist.is_main else None
        self._claimed = False  # the run folder checked (fresh or resumed) by this trainer
        self.state = new_state(self.max_steps, cfg.logging_steps, cfg.save_steps,
                               cfg.per_device_train_batch_size * self.dist.world, self.dist.is_main,
                               self.dist.local_rank == 0)
        self.callback_handler = Callbacks(callbacks, cfg, self.state, model=self.model, processing_class=self.tok,
                                          optimizer=self.optimizer, lr_scheduler=self.scheduler)
        self.callback_handler("on_init_end")

    def add_callback(self, callback) -> None:
        """transformers' Trainer.add_callback."""
        self.callback_handler.add(callback)

    # ---- optimizer -----------------------------------------------------------------------------
    def optimizer_step(self, bad: str | None) -> float:
        """Apply one update's gradients (optim.step_optimizer); raises TrainingError on a bad step."""
        return step_optimizer(self.params, self.optimizer, self.scheduler, self.dist, self.device,
                                   self.cfg.max_grad_norm, bad, self.bad_step)

    def bad_step(self, what: str) -> str:
        last = ckpt.checkpoints(self.out)
        keep = f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was written yet"
        word = "step" if self.KIND == "train" else f"{self.KIND} step"
        return f"{word} {self.step}: {what}; the step's update was not applied and training stops ({keep})"

    # ---- checkpoints and the run folder ----------------------------------------------------------
    def save(self) -> Path | None:
        """Rank 0 writes the checkpoint (the ranks' adapters, optimizer states and data positions are
        identical); the others wait for it. A checkpoint holds nothing per rank, so a run resumes with
        the same or a different number of ranks."""
        path = None
        if self.dist.is_main:
            extra, tensors = self.checkpoint_contents()
            extra["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            extra["global_step"] = self.global_step  # the folder's number; `step` (the trainer's) is restored
            path = ckpt.save_checkpoint(self.out, self.step, self.model, self.optimizer, self.scheduler, extra,
                                        base_name=self.base_name(), keep=self.cfg.save_total_limit, tensors=tensors,
                                        name=self.global_step)
        self.dist.barrier()
        if path is not None or not self.dist.is_main:
            self.callback_handler("on_save")
        return path

    def _claim(self, fresh: bool) -> None:
        """Lock the run folder and clean what a killed save left; a fresh run's folder must hold no
        earlier run (or overwrite_output_dir clears it). Rank 0 does it; every rank stops on its error."""
        err = None
        if self._lock is not None:
            try:
                self._lock.acquire()
                if not self._claimed:
                    run_folder.clean_temporaries(self.out)
                    if fresh:
                        # the run's inputs: a run started from Python is guarded as `qerl train` is
                        run_folder.refuse_or_clear(self.out, self.cfg.overwrite_output_dir,
                                                   run_folder.run_inputs(self.cfg), self.KIND)
            except (ValueError, OSError) as e:  # RunFolderError, or an input unreadable: every rank stops on it
                err = e
        if self.dist.max(1.0 if err else 0.0, self.device):
            self._release()  # a lock we took is not left behind by a refusal
            raise err or run_folder.RunFolderError(f"{self.out}: rank 0 could not claim the run folder")
        self._claimed = True

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def _load(self, folder: Path) -> dict:
        self.check_checkpoint(folder)  # before anything is loaded
        return ckpt.load_checkpoint(folder, self.model, self.optimizer, self.scheduler)

    def _newest_good_checkpoint(self) -> tuple[Path, dict]:
        """Load the newest checkpoint whose files all verify, skipping (and setting aside) corrupt ones."""
        found = ckpt.checkpoints(self.out, complete=False)
        if not found:
            raise FileNotFoundError(f"{self.out}: no checkpoint to resume from")
        skipped = []
        for folder in reversed(found):
            try:
                st = self._load(folder)
            except ckpt.CorruptCheckpoint as e:
                print(f"qerl: resume: skipping {folder.name}: {e}", flush=True)
                skipped.append((folder, str(e)))
                continue
            if self._lock is not None:
                for bad, _ in skipped:  # out of the rotation and of later resumes; kept for a look
                    aside = bad.with_name(bad.name + ".corrupt")
                    n = 1
                    while aside.exists():  # set aside before, in an earlier resume
                        aside, n = bad.with_name(f"{bad.name}.corrupt{n}"), n + 1
                    os.replace(bad, aside)
                    print(f"qerl: resume: moved {bad.name} to {aside.name}", flush=True)
            return folder, st
        raise ckpt.CorruptCheckpoint(f"{self.out}: no checkpoint verifies: " + "; ".join(why for _, why in skipped))

    def resume(self, folder=None) -> int:
        """Continue from `folder`, or the run directory's newest checkpoint that verifies. Returns the step."""
        self._claim(fresh=False)
        try:
            if folder is None:
                folder, st = self._newest_good_checkpoint()
            else:
                st = self._load(Path(folder))
            self.restore(st, Path(folder))
        except BaseException:
            self._release()
            raise
        self.step = st["step"]
        self._resumed_from = Path(folder)
        self.state.global_step = self.global_step
        self.state.epoch = self.epoch()
        self.state.num_input_tokens_seen = st.get("num_input_tokens_seen", 0)
        return self.step

    # ---- the run ---------------------------------------------------------------------------------
    def train(self, stop_after: int | None = None) -> list[dict]:
        """Run to max_steps (or stop after `stop_after` more steps, as a killed run would, but with a
        checkpoint at the stop); returns the metrics rows of this run."""
        self._claim(fresh=self._resumed_from is None)
        try:
            with self.scope():
                return self._train(stop_after)
        finally:
            self._release()

    def _open_log(self) -> MetricsLog | None:
        if not self.dist.is_main:  # rank 0 logs; the metrics it writes are already aggregated over the ranks
            return None
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        continuing = self._resumed_from is not None or self.step > 0  # a resume, or train() called again
        path = self.out / "config.yaml"
        # a resume keeps qerl.trl's in-memory note: the run's model may hold changes its name does not
        note = in_memory_note(path.read_text()) if continuing and path.exists() else ""
        path.write_text(cfg.to_yaml() + note)
        log = MetricsLog(self.out, cfg.report_to, resume_step=self.global_step if continuing else None,
                         config=cfg.to_dict(), run_name=self.run_name())
        if continuing and not self.state.log_history and log.path.exists():
            # a resumed run's history before its checkpoint: the rows metrics.jsonl kept (the same numbering)
            self.state.log_history = [log_entry(r, r["step"], None) for r in read_rows(log.path)]
        return log

    def record(self, m: dict, log) -> None:
        """A step's metrics: metrics.jsonl and the trackers, trainer.state, the callbacks' on_log. The row's
        step becomes the global_step (a trainer's train_step may number it its own way)."""
        m["step"] = self.global_step
        if log is not None:
            log.write(m)
        st = self.state
        st.global_step, st.epoch = self.global_step, self.epoch()
        entry = log_entry(m, st.global_step, st.epoch)
        st.log_history.append(entry)
        self.callback_handler("on_step_end")
        self.callback_handler("on_log", logs=entry)

    def record_eval(self, row: dict) -> None:
        """An evaluation's row (already in metrics.jsonl): log_history and on_evaluate."""
        entry = log_entry(row, self.global_step, self.state.epoch)
        self.state.log_history.append(entry)
        self.callback_handler("on_evaluate", metrics=entry)

    def _print_line(self, m: dict, bar) -> None:
        line = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()
                        if k in self.LOG_KEYS)
        bar.write(line) if self.progress else print(line, flush=True)  # above the bar, when shown

    def _passed(self, every: float | None) -> bool:
        """This step's global_step reached a multiple of `every`, as transformers' global_step % every == 0
        (a step of several optimizer steps may pass one without landing on it: then at that step); every < 1
        is a fraction of the run, as transformers reads logging/save/eval_steps (0 or None: never)."""
        if not every:
            return False
        every = max(1, math.ceil(every * self.global_max_steps) if every < 1 else int(every))
        n = self.global_steps_per_step
        return self.global_step // every != (self.global_step - n) // every

    def _logs_now(self) -> bool:
        """A multiple of logging_steps was reached by this step."""
        return self._passed(self.cfg.logging_steps)

    def _say(self, line: str, bar) -> None:
        bar.write(line) if self.progress else print(line, flush=True)

    def _train(self, stop_after: int | None) -> list[dict]:
        cfg, main = self.cfg, self.dist.is_main
        end = self.max_steps if stop_after is None else min(self.max_steps, self.step + stop_after)
        self.state.max_steps = self.global_max_steps
        log = self._open_log()
        rows, bar = [], None
        t0 = time.perf_counter()
        # On the CPU no kernel decodes 4-bit weights in registers: keep each frozen weight's
        # dequantized copy for the whole run (they never change) instead of rebuilding it per call.
        from ..kernels import dispatch

        cache = dispatch.dequantized_cache() if self.device.type == "cpu" else contextlib.nullcontext()
        cache.__enter__()
        try:
            self.callback_handler("on_train_begin")
            self.before_steps(log)
            # after the start evaluation, which is its own phase: the bar's rate and ETA count steps only
            # the bar counts global steps; its time left is the clock's (one-off first-step costs left out)
            bar = tqdm(total=self.global_max_steps, initial=self.global_step, desc=self.KIND, unit="step",
                       disable=not (self.progress and main),
                       bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
            clock = RunClock(self.max_steps, self.occasional_costs())
            while self.step < end:
                self.callback_handler("on_step_begin")
                clock.begin()
                m = self.train_step()
                if self.device.type == "cpu":
                    release_host_memory()  # freed tensors back to the OS, not kept in the heap (device_memory)
                self.record(m, log)
                rows.append(m)
                bar.update(self.global_steps_per_step)
                left = clock.step_done(self.step, m)
                bar.set_postfix(**self.postfix(m), left=left.short())
                if main and clock.steps == 1 and self.step < self.max_steps:
                    self._say(f"qerl {self.KIND}: {left.line()}", bar)
                if main and self._logs_now():
                    self._print_line(m, bar)
                control = self.callback_handler.control
                stop = control.should_training_stop
                # save_steps count global steps, as transformers': checkpoint-<global_step>
                scheduled = self._passed(cfg.save_steps) or self.step == end or stop
                if (cfg.save_strategy != "no" and scheduled) or control.should_save:
                    with self.profiler.phase("checkpoint"):  # reported in the next step's row
                        self.save()
                    control.should_save = False
                self.after_step(m, log, bar)
                if stop:
                    break
        finally:
            self.stop_background()
            cache.__exit__(None, None, None)
            if bar is not None:
                bar.close()
            if log is not None:
                log.close()
        if main:
            self._write_adapter()
        self.state.log_history.append(summary_entry(rows, time.perf_counter() - t0, self.global_step,
                                                       self.state.epoch))
        self.callback_handler("on_train_end")
        self.dist.barrier()
        return rows

    def _write_adapter(self) -> None:
        """output_dir/adapter: PEFT's format with the tokenizer (as TRL saves it: a model to start from on
        its own), under checksums written last, over every file (load_adapter verifies them)."""
        from ..checkpoint.checksums import write_checksums
        from ..checkpoint.peft_adapter import save_adapter

        save_adapter(self.model, self.out / "adapter", base_model_name_or_path=self.base_name(), checksums=True,
                     modules_to_not_convert=getattr(self.policy, "modules_to_not_convert", None))
        self.tok.save_pretrained(self.out / "adapter")
        write_checksums(self.out / "adapter")
