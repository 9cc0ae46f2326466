"""The QeRL training loop (paper.md, Algorithm 1): GRPO / DAPO on a quantized LoRA policy with AQN.

`train_step` is a loop over named, timed phases (train/profiling.py), each in its own module and each a
function of explicit inputs and the step's frozen context (rl/step_context.py):
rollout (rl/rollout_phase.py: G rollouts per prompt from the noisy behaviour policy, rewards, DAPO's
dynamic sampling) -> advantages (rl/advantages.py) -> metrics (rl/rollout_metrics.py) -> update
(train/update.py with GRPO's objective, rl/objective.py: num_iterations passes of clipped policy-gradient
updates; the trainer's `optimizer_step` applies each) -> checkpoint (train/checkpoints.py).
With max_staleness 1 the rollout of the next step runs during the update (rl/staleness.py) on the
engine's own adapter copy (rl/adapter_snapshot.py). The KL reference, when beta > 0, is the same
model with adapters off.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

from ..kernels import dispatch, settings
from ..kernels.settings import KernelSettings
from ..model.adapter_start import base_of
from ..rollout import Engine
from ..train import checkpoints as ckpt
from ..train.loop import TrainLoop
from ..train.parts import Needs, TrainParts
from ..train.profiling import Profiler
from .advantages import rollout_batch
from .adapter_snapshot import AdapterSnapshot
from .aqn import AQN, AdaptiveSigma, sigma_at
from .batch_sizes import batch_plan
from .config import GRPOConfig
from ..train.metrics import MetricsLog
from .parity import ParityGate, ParityInputs
from .rollout_metrics import rollout_metrics
from .rollout_phase import RolloutInputs, StepRollouts, collect
from ..train.sampler import PromptSampler
from .rollout_source import RolloutSource
from .staleness import ROLLOUT_ADAPTER, InFlight, context_of
from .step_context import StepContext, step_seed
from .objective import PolicyObjective, PolicySettings, update_settings
from ..train.optim import TrainingError
from ..train.update import PolicyUpdate, UpdateInputs

from ..tasks.prompts import PAPER_SUFFIX, encode_prompt, prompt_cut  # noqa: F401 - PAPER_SUFFIX re-exported

__all__ = ["GRPOTrainer", "PromptSampler", "TrainingError"]


class GRPOTrainer(TrainLoop):
    """`GRPOTrainer(config).train()`; or pass a built `policy`, a `task` (train/eval rows and
    reward functions), or `reward_funcs` + `train_dataset` as in TRL.

    tools: callables (or qerl.tools.Tool) the policy may call in multi-turn rollouts, as TRL's
    `tools=`; their JSON schemas come from signatures and docstrings and are offered in each chat
    prompt's system turn. A task that carries tools (tool_arithmetic) brings its own.
    environment_factory: builds a per-sample environment with reset(row) / respond(text) (see
    qerl.tools.ToolEnvironment) for tasks that need state; it replaces the plain tool runner.

    `sample_max_new_tokens` (an attribute, None by default): (prompt key, sample index) -> that
    sample's own limit of new tokens in the rollouts (SamplingParams.sample_max_new_tokens; benchmarks
    use it to end completions at chosen lengths). A rollout reads it when it is launched."""

    def __init__(self, config: GRPOConfig | None = None, *, policy=None, task=None, reward_funcs=None,
                 train_dataset=None, eval_dataset=None, tools=None, environment_factory=None, progress: bool = True,
                 kernel_settings: KernelSettings | None = None, callbacks=None):
        """kernel_settings: the kernel choices (kernels.settings.KernelSettings) its steps, rollouts and
        evaluations run under; None: the caller's. callbacks: transformers TrainerCallback objects
        (train/callbacks.py)."""
        cfg = config or GRPOConfig()
        self.kernel_settings = kernel_settings
        if cfg.max_staleness not in (0, 1):
            raise ValueError(f"config field 'max_staleness': {cfg.max_staleness} is not supported (0: synchronous, "
                             "1: the next step's rollout during the update)")
        data = (task, reward_funcs, train_dataset, eval_dataset, tools, environment_factory)
        parts = TrainParts.build(cfg, Needs(micro_batch_tokens=self._micro_batch_tokens,
                                            total_updates=self._total_updates, trainable=self._trainable,
                                            on_ranks=self._check_ranks,
                                            on_policy=lambda parts: self._setup_data(parts.cfg, *data),
                                            reserve_bytes=self._setup_engine),
                                 policy=policy, progress=progress, announce=True)
        cfg = parts.cfg  # final: the memory levers filled in
        self.aqn = AQN(parts.model) if cfg.aqn else None  # the live norms: the update's noise (aqn_in_training)
        # the rollout's noise lives on the engine's norms: the snapshot's own under max_staleness 1
        self.rollout_aqn = (AQN(self.snapshot.model) if cfg.aqn else None) if self.snapshot is not None else self.aqn
        # closed-loop AQN: sigma steered by a rollout signal instead of the stage schedule
        self.adaptive = AdaptiveSigma(cfg.aqn_adaptive_target, cfg.aqn_adaptive_signal, cfg.aqn_sigma_end,
                                      cfg.aqn_sigma_start, cfg.aqn_adaptive_gain) \
            if cfg.aqn and cfg.aqn_schedule == "adaptive" else None
        self.sampler = PromptSampler(len(self.train_rows), cfg.seed)
        self._say_cut_prompts(parts)
        # each step's rollout: collected at the step (max_staleness 0) or launched during the last update (1)
        self.rollouts = RolloutSource(self.snapshot, context=self.step_context, inputs=self.rollout_inputs,
                                      collect=self.collect_rollouts, sampler_state=lambda: self.sampler.state(),
                                      warm=self._warm_decode_graphs, threaded=parts.dist.world == 1,
                                      device=parts.device)
        self.sample_max_new_tokens = None
        self.update = PolicyUpdate(UpdateInputs(parts.model, update_settings(cfg), parts.device, parts.dtype,
                                                parts.tok.pad_token_id or 0, parts.dist, parts.profiler,
                                                self.optimizer_step),
                                   PolicyObjective(PolicySettings.of(cfg), self.aqn, parts.dist, parts.device))
        self.parity = ParityGate()  # checks with ParityInputs.of(self): the trainer's state at the time
        self.setup_loop(parts, callbacks)  # the run folder, trainer.state, the callbacks (train/loop.py)

    # ---- construction (what TrainParts.build asks, in its order) ----------------------------
    def _check_ranks(self, parts: TrainParts) -> None:
        cfg = parts.cfg
        self.plan = batch_plan(cfg, parts.dist.world)  # TRL's batch semantics; explains a batch that cannot split
        if cfg.max_staleness and cfg.lora_dropout and parts.device.type == "cuda":
            # the engine's CUDA graphs sample from the default CUDA generator (seeded per rollout), which
            # dropout in the concurrent update would draw from too: neither would be reproducible
            raise ValueError("config fields 'max_staleness' and 'lora_dropout': a rollout beside the update "
                             "shares the default CUDA generator with the update's dropout on a GPU; set "
                             "lora_dropout: 0 (the default) or max_staleness: 0")

    def _micro_batch_tokens(self, parts: TrainParts) -> int:
        cfg = parts.cfg
        return cfg.per_device_train_batch_size * (cfg.max_prompt_length + cfg.max_completion_length)

    def _total_updates(self, parts: TrainParts) -> int:
        self._updates_per_step = parts.cfg.num_iterations * self.plan.updates_per_rank  # on each rank
        return parts.cfg.max_steps * self._updates_per_step

    def _setup_data(self, cfg: GRPOConfig, task, reward_funcs, train_dataset, eval_dataset, tools,
                    environment_factory) -> None:
        if task is None and train_dataset is None:
            from ..tasks import get_task

            task = get_task(cfg.dataset_name, **cfg.dataset_config)
        self.train_rows = list(train_dataset) if train_dataset is not None else task.train
        self.reward_funcs = list(reward_funcs) if reward_funcs is not None else task.reward_funcs
        self.reward_weights = cfg.reward_weights if cfg.reward_weights is not None else \
            (getattr(task, "reward_weights", None) if reward_funcs is None else None)
        self.task = task
        self._eval_rows = list(eval_dataset) if eval_dataset is not None else None
        self.tools = list(tools) if tools is not None else list(getattr(task, "tools", None) or [])
        self.environment_factory = environment_factory
        if tools:  # the user's own rows: offer the tools in their chat prompts (a task's rows already do)
            from ..tools.chat import offer_tools

            self.train_rows = offer_tools(self.train_rows, self.tools)
            if self._eval_rows is not None:
                self._eval_rows = offer_tools(self._eval_rows, self.tools)
        self.evals: list[dict] = []  # one summary per evaluation of this run
        if not self.reward_funcs:
            raise ValueError("no reward functions: pass reward_funcs or a task that has them")
        from ..tasks.rows import check_rows

        check_rows(self.train_rows, "train_dataset")  # every row, not only row 0

    def _trainable(self, parts: TrainParts) -> list:
        if parts.cfg.train_norms:
            for n, p in parts.model.named_parameters():
                if n.endswith("norm.weight") and ".layers." in n:
                    p.requires_grad_(True)
        return [p for p in parts.model.parameters() if p.requires_grad]

    def _setup_engine(self, parts: TrainParts) -> int:
        """The rollout engine: on the live policy, or (max_staleness 1) on its own adapter copy, built
        before the memory levers, which must leave its bytes free. Returns what a rollout beside the
        update needs besides (rollout_reserve_bytes)."""
        cfg, model = parts.cfg, parts.model
        self.snapshot = AdapterSnapshot(model, parts.params) if cfg.max_staleness else None
        self.engine = Engine(self.snapshot.model if self.snapshot is not None else model, parts.tok,
                             max_len=cfg.max_prompt_length + 1 +
                             max(cfg.max_completion_length, cfg.eval_max_completion_length or 0),
                             max_slots=max(self.plan.generation_batch_size // parts.dist.world,
                                           min(256, self._eval_slots(cfg))),
                             kv_cache_gb=cfg.rollout_kv_cache_gb if cfg.rollout_kv_cache_gb is not None else
                             (None if parts.device.type == "cuda" else 2.0), kv_cache_dtype=cfg.rollout_kv_cache_dtype,
                             kernel_settings=self.kernel_settings)
        return self.rollout_reserve_bytes()

    def rollout_reserve_bytes(self) -> int:
        """Memory the update cannot use because a rollout runs beside it (max_staleness 1): the decode
        step's transient buffers, a few fp32 [slots, vocab] (logits, processed probabilities, sampler).
        The adapter copy is already allocated when the levers measure free memory; the batch in flight
        (token ids, logprobs) is host memory."""
        if self.snapshot is None:
            return 0
        return 3 * self.engine.n_slots * self.engine.view.vocab * 4

    # ---- prompts ---------------------------------------------------------------------------
    def _say_cut_prompts(self, parts: TrainParts) -> None:
        """Prompts past max_prompt_length lose their start in every rollout: said once, counted."""
        if not parts.dist.is_main:
            return
        cut = prompt_cut(parts.tok, self.train_rows, parts.cfg.max_prompt_length,
                         system_prompt=parts.cfg.system_prompt, suffix=parts.cfg.prompt_suffix)
        if cut.cut:
            print(cut.line(), file=sys.stderr, flush=True)

    def encode_prompt(self, row) -> list[int]:
        return encode_prompt(self.tok, row["prompt"], system_prompt=self.cfg.system_prompt,
                             suffix=self.cfg.prompt_suffix, max_length=self.cfg.max_prompt_length)

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools or self.environment_factory) and self.cfg.max_turns > 0

    def turns_for(self, rows):
        """The multi-turn handler of a rollout over `rows` (None without tools): one environment per sample."""
        if not (self.tools or self.environment_factory) or self.cfg.max_turns == 0:
            return None
        from ..tools import ToolLimits, ToolTurnHandler

        limits = ToolLimits(timeout_s=self.cfg.tool_timeout_s, max_output_chars=self.cfg.tool_max_output_chars)
        return ToolTurnHandler(self.tok, rows, self.tools, env_factory=self.environment_factory, limits=limits,
                               max_turns=self.cfg.max_turns)

    # ---- one step --------------------------------------------------------------------------
    def step_context(self, step: int, adapter_version: int) -> StepContext:
        """The frozen context of `step`'s phases: its AQN noise (the schedule's, or the closed loop's
        current sigma), its seeds, and the adapter version its rollout samples from."""
        cfg = self.cfg
        if self.adaptive is not None:  # one continuous noisy stage whose sigma the controller sets
            sigma, stage = self.adaptive.sigma, 1
        else:
            sigma, stage = sigma_at(step, cfg.max_steps, min(cfg.aqn_stages, cfg.max_steps), cfg.aqn_sigma_start,
                                    cfg.aqn_sigma_end, cfg.aqn_schedule) if self.aqn is not None else (0.0, 0)
        return StepContext(step, sigma, stage, step_seed(cfg.seed, step), adapter_version)

    def rollout_inputs(self, profiler: Profiler | None = None) -> RolloutInputs:
        return RolloutInputs(self.cfg, self.engine, self.tok, self.train_rows, self.reward_funcs, self.reward_weights,
                             self.dist, self.device, self.encode_prompt, self.turns_for, self.rollout_aqn,
                             profiler or self.profiler, self.sample_max_new_tokens, self.state,
                             self.environment_factory)

    def collect_rollouts(self, ctx: StepContext, inputs: RolloutInputs | None = None) -> StepRollouts:
        """The step's rollouts, now, from the adapter the engine reads (the live one, or the snapshot)."""
        return collect(inputs or self.rollout_inputs(), ctx, self.sampler, self.plan.prompts_per_rank)

    def launch_rollout(self, step: int, ctx: StepContext | None = None) -> InFlight:
        """Start `step`'s rollout from the current adapter (copied into the engine's snapshot), or from
        the adapter already in it when `ctx` is given (a resume): rl/rollout_source.py."""
        return self.rollouts.launch(step, self.step, ctx)

    def train_step(self) -> dict:
        with self.scope():
            return self._train_step()

    def _train_step(self) -> dict:
        cfg, step, D, phase = self.cfg, self.step, self.dist, self.profiler.phase
        t0 = time.perf_counter()
        parity, times = {}, {}
        if not self.rollouts.ahead:
            ctx = self.step_context(step, step)
            if self.parity.due(step, cfg.parity_check_steps):
                with phase("parity"):  # before the rollout: its engine seeding then starts the step's sampling afresh
                    parity = self.parity(step, ParityInputs.of(self))
            with phase("rollout"):  # rewards included (dynamic sampling needs them to decide on more rounds)
                ro = self.collect_rollouts(ctx)
        else:
            with phase("rollout_wait"):  # what the step waits for its rollout, launched during the last update
                ro, times = self.rollouts.take(step, self.step)  # (launched now at a run's or resume's first step)
            ctx = ro.ctx
            times["time_rollout"] = ro.seconds
            if self.parity.due(step, cfg.parity_check_steps):
                with phase("parity"):
                    parity = self.parity(step, ParityInputs.of(self))
        with phase("advantages"):
            batch = rollout_batch(ro.groups, cfg.num_generations, cfg.scale_rewards, D)
        with phase("metrics"):  # over everything sampled this step (before filtering), over all ranks
            m = {"step": step, "sigma": ctx.sigma, "aqn_stage": ctx.stage, "aqn_sigma_effective": ro.effective_sigma,
                 "staleness": ctx.staleness, "lr": self.scheduler.get_last_lr()[0],
                 "rollout_graphs_captured": sum(r.stats.graphs_captured for r in ro.rounds),
                 **rollout_metrics(ro.rounds, ro.n_informative, D, self.offers_tools, ro.logged), **parity}
            # TRL's names: the learning rate; num_tokens counts every prompt and completion token so far
            self.state.num_input_tokens_seen += m["rollout_input_tokens"]
            m.update(learning_rate=m["lr"], num_tokens=self.state.num_input_tokens_seen)
            if D.world > 1:
                m["world_size"] = D.world
            if self.adaptive is not None:  # this step's signal sets the next step's sigma
                measured = m["rollout_entropy"] if cfg.aqn_adaptive_signal == "entropy" else m["zero_variance_fraction"]
                self.adaptive.update(measured)  # (a first step with no target set makes this its target)
                m.update({"aqn_target": self.adaptive.target, "aqn_signal": measured})
        if self.rollouts.ahead and step + 1 < cfg.max_steps:
            self.rollouts.launch(step + 1, self.step)  # samples from this adapter while the update trains
        if not self.rollouts.ahead:  # no rollout beside the update: the folded rollout weights go (CPU)
            dispatch.drop_folded()
        # every rank enters the update: the gradient average is collective, even for an empty share
        if D.sum(len(batch), self.device):
            m.update(self.update(batch, ctx.sigma, ctx.seed))
        else:  # nothing informative this step: no update (loss, entropy, grad norm are not logged)
            m["updates"] = 0
        m.update({"time_logprob": 0.0, "time_update": 0.0, **self.profiler.take(), **times})
        m["time_step"] = time.perf_counter() - t0
        m["completions"] = int(D.sum(len(batch), self.device))
        self.step += 1
        return m

    def _warm_decode_graphs(self) -> None:
        """Capture every decode graph a training rollout can use (each batch bucket up to this rank's
        rows, each key length) now, while nothing runs beside: a capture on the worker thread while
        the update allocates and launches on the main thread would break the capture."""
        from ..rollout import SamplingParams
        from ..rollout.scheduler import BUCKETS

        cfg = self.cfg
        rows = min(self.engine.n_slots, self.plan.prompts_per_rank * cfg.num_generations)
        sizes = [b for b in BUCKETS if b < rows] + [rows]
        self.engine.warmup(sizes, SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k))

    def close(self) -> None:
        """Let a rollout still in flight (max_staleness 1, after a bare `train_step`) finish and drop it;
        `train()` needs no call: no rollout outlives it."""
        self.rollouts.close()

    def sync_rollout_adapter(self) -> None:
        """Let the engine sample from the live adapter now (parity checks, evaluation): copies it into the
        engine's snapshot under max_staleness 1, after any rollout in flight has finished with it."""
        self.rollouts.sync(self.step)

    # ---- evaluation ------------------------------------------------------------------------
    @staticmethod
    def _eval_slots(cfg: GRPOConfig) -> int:
        evaluates = cfg.eval_steps or cfg.eval_on_start or cfg.eval_on_end
        return cfg.eval_num_samples * (cfg.eval_limit or 256) if evaluates else 0

    def eval_set(self):
        """(rows, accuracy function, name) of the held-out set."""
        cfg = self.cfg
        if cfg.eval_dataset_name:
            from ..tasks import get_task

            t = get_task(cfg.eval_dataset_name, **cfg.eval_dataset_config)
            rows, func, name = t.eval, t.accuracy_func(), cfg.eval_dataset_name
        elif self._eval_rows is not None:
            acc = [f for f in self.reward_funcs if getattr(f, "metric", None) == "accuracy"]
            rows, func, name = self._eval_rows, (acc or self.reward_funcs)[0], "eval_dataset"
        elif self.task is not None:
            rows, func, name = self.task.eval, self.task.accuracy_func(), self.task.name
        else:
            raise ValueError("evaluation needs eval_dataset_name, an eval_dataset or a task with a held-out split")
        return (rows[:cfg.eval_limit] if cfg.eval_limit else rows), func, name

    def evaluate(self, log: MetricsLog | None = None):
        """pass@1 on the held-out set with the current adapter (no AQN noise); writes
        output_dir/eval/step_N.json and, given `log`, a metrics row."""
        from .evaluate import evaluate

        cfg = self.cfg
        rows, func, name = self.eval_set()
        self.sync_rollout_adapter()
        rep = evaluate(self.engine, self.tok, rows, func, samples=cfg.eval_num_samples, temperature=cfg.eval_temperature,
                       top_p=cfg.eval_top_p, max_new_tokens=cfg.eval_max_completion_length or cfg.max_completion_length,
                       seed=cfg.seed, system_prompt=cfg.system_prompt, prompt_suffix=cfg.prompt_suffix,
                       max_prompt_length=cfg.max_prompt_length, dataset=name, progress=self.progress,
                       turns_for=self.turns_for if (self.tools or self.environment_factory) else None)
        rep.write(self.out / "eval" / f"step_{self.global_step}.json")  # numbered as its metrics row
        row = {"step": self.global_step, "eval_pass_at_1": rep.pass_at_1, "eval_stderr": rep.stderr,
               "eval_mean_score": rep.mean_score, "eval_completion_length_mean": rep.completion_length_mean,
               "eval_problems": rep.problems, "eval_samples": rep.samples, "time_eval": rep.seconds}
        if rep.tool_call_rate is not None:
            row["eval_tool_call_rate"] = rep.tool_call_rate
        if log is not None:
            log.write(row)
        self.evals.append(row)
        self.record_eval(row)
        if not self.progress:
            print(f"eval step {self.step}: {rep.summary()}", flush=True)
        return rep

    # ---- checkpoints -----------------------------------------------------------------------
    def checkpoint_contents(self) -> tuple[dict, dict | None]:
        # a rollout in flight is not waited for: the checkpoint holds what launches it again (its
        # adapter, context and the sampler's position before its draws), rl/staleness.py
        data, in_flight, tensors = self.rollouts.record()
        extra = {"data": data if data is not None else self.sampler.state(), "config": self.cfg.to_dict(),
                 "world_size": self.dist.world, "updates_per_step": self._updates_per_step}
        if in_flight is not None:
            extra["in_flight"] = in_flight
        if self.adaptive is not None:
            extra["aqn_adaptive"] = self.adaptive.state_dict()
        return extra, tensors

    def base_name(self) -> str:
        return base_of(self.cfg.model_name_or_path)

    def check_checkpoint(self, folder: Path) -> None:
        self._read_in_flight(folder)  # its in-flight record, checked before anything is loaded

    def restore(self, st: dict, folder: Path) -> None:
        in_flight = self._read_in_flight(folder)
        then = st.get("updates_per_step", self._updates_per_step)
        if then != self._updates_per_step:
            # another number of ranks makes another number of updates a step: the schedule's position
            # counts updates, so move it to the same step of the schedule
            sch = self.scheduler
            sch.last_epoch = round(sch.last_epoch * self._updates_per_step / then)
            for g, base, f in zip(self.optimizer.param_groups, sch.base_lrs, sch.lr_lambdas):
                g["lr"] = base * f(sch.last_epoch)
            sch._last_lr = [g["lr"] for g in self.optimizer.param_groups]
        self.sampler = PromptSampler(len(self.train_rows), self.cfg.seed, st["data"]["epoch"], st["data"]["pos"])
        if self.adaptive is not None and "aqn_adaptive" in st:
            self.adaptive.load_state_dict(st["aqn_adaptive"])
        # the rollout that was in flight is launched again from its own adapter by the next step (inside
        # the run, as every launch); with max_staleness 0 now the sampler stands before its draws and the
        # current adapter redraws it
        self.rollouts.restore(in_flight, folder)

    def _read_in_flight(self, folder) -> tuple[StepContext, dict] | None:
        """The context and adapter of the rollout a checkpoint was written with in flight, or None."""
        st_file = Path(folder) / ckpt.STATE_NAME
        try:
            rec = json.loads(st_file.read_text()).get("in_flight")
        except (OSError, ValueError):
            return None  # load_checkpoint names what is wrong with the state file
        if rec is None:
            return None
        return context_of(rec, str(st_file)), ckpt.read_tensors(folder, ROLLOUT_ADAPTER)

    # ---- the run (train/loop.py's; what GRPO adds around its steps) -----------------------------
    def scope(self):
        """The trainer's kernel settings in force (a rollout thread runs in a copy of this context)."""
        return settings.use(self.kernel_settings) if self.kernel_settings is not None else contextlib.nullcontext()

    def epoch(self) -> float:
        return self.sampler.epoch + self.sampler.pos / max(1, len(self.train_rows))

    def postfix(self, m: dict) -> dict:
        return {"reward": f"{m['reward_mean']:.3f}", "sigma": f"{m['sigma']:.1e}", "len": f"{m['completion_length_mean']:.0f}"}

    def before_steps(self, log) -> None:
        cfg = self.cfg
        if cfg.eval_on_start and self.step == 0 and self._resumed_from is None:
            self._evaluate_on_main(log)
        if cfg.eval_on_end and self._resumed_from is not None and self.step == cfg.max_steps:
            self._evaluate_on_main(log)  # stopped after its last checkpoint, before its last evaluation

    def after_step(self, m: dict, log, bar) -> None:
        cfg = self.cfg
        last = self.step == cfg.max_steps
        # eval_steps counts the run's own step numbers (TRL's global_step on a TRL-numbered run): evaluate when this
        # step crossed a multiple of it (a step of several optimizer steps may pass one without landing on it)
        g, n = self.global_step, self.global_steps_per_step
        if (cfg.eval_steps and g // cfg.eval_steps > (g - n) // cfg.eval_steps) or (last and cfg.eval_on_end):
            if last:
                bar.close()  # the final evaluation is its own phase, after the train bar
            self._evaluate_on_main(log)
            bar.unpause()  # the evaluation's time is not a step's

    def occasional_costs(self) -> dict:
        every, end = self.cfg.parity_check_steps, self.max_steps
        # the check runs at the start of steps 0, every, 2 x every, ... (ParityGate.due)
        return {"time_parity": lambda done: len(range(-(-done // every) * every, end, every)) if every else 0}

    def stop_background(self) -> None:
        self.rollouts.wait_quietly()  # no rollout outlives train(); a later call joins its result

    def _evaluate_on_main(self, log):
        """Rank 0 evaluates (its adapter is every rank's); the others wait at the barrier."""
        if self.dist.is_main:
            self.evaluate(log)
        self.dist.barrier()
