"""The GRPO training configuration: TRL's GRPOConfig names where TRL has one, the shared fields from
train/config.py.

Every field carries its help text, so `qerl train --print_config` writes a YAML file
with every default documented, and the CLI accepts any field as `--name value`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..train.config import TrainConfig
from ..train.fields import parse_value, setting, typed


LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
TOKEN_NORMALIZERS = ("generation", "update")

# TRL's names for qerl's fields (the vllm_ prefix is TRL's history: its engine was vLLM), and qerl's
# own older names. A file, a flag or GRPOConfig(...) may use either; the config keeps qerl's.
FIELD_ALIASES = {
    "vllm_importance_sampling_correction": "importance_sampling_correction",
    "vllm_importance_sampling_mode": "importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "importance_sampling_cap",
    "vllm_importance_sampling_cap": "importance_sampling_cap",  # TRL's deprecated name of clip_max
    "vllm_importance_sampling_clip_min": "importance_sampling_cap_min",
    "entropy_coeff": "entropy_coef",  # qerl's name before TRL's aggregation (verl's name)
    "torch_dtype": "dtype",  # TRL's ModelConfig
}
# TRL's fields that qerl has none for (engines, precision, logging, the hub, the data loader; fields that would
# change training): train/trl_fields.py, one table of TRL 1.16's fields and defaults and the rule for each.
AQN_SCHEDULES = ("exponential", "linear", "cosine", "logarithmic", "adaptive")


@dataclass
class GRPOConfig(TrainConfig):
    """GRPO / DAPO with AQN: the shared fields (train/config.py) and the rollout, loss, noise, evaluation
    and tool fields."""
    # --- model -------------------------------------------------------------------------------
    train_norms: bool = setting(False, "Also train the RMSNorm weights (the reference code's 'ln' option).")
    # --- data --------------------------------------------------------------------------------
    dataset_name: str = setting("arithmetic", "A task name (see `qerl.tasks`), a local .jsonl/.parquet file, or a hub dataset.")
    dataset_config: dict = setting({}, "Task / dataset options (e.g. size, seed, column mapping).")
    system_prompt: str | None = setting(None, "Optional system message for chat templates.")
    prompt_suffix: bool = setting(False, "Append the paper's <think>/<answer> instruction to each prompt.")
    # --- optimisation ------------------------------------------------------------------------
    generation_batch_size: int | None = setting(None, "Completions sampled per step, all ranks (prompts per step x "
                                                "num_generations; null: per_device_train_batch_size x world size x "
                                                "steps_per_generation, as TRL).")
    steps_per_generation: int | None = setting(None, "Micro-batches each rank trains on per step (TRL's meaning; null: "
                                               "gradient_accumulation_steps, one update a generation, as TRL; or what "
                                               "generation_batch_size implies when set).")
    packed_update: bool = setting(True, "Pack each group's prompt (once) and its completions into one row with a "
                                  "prefix-sharing mask: no padding, the prompt's forward and backward once per group "
                                  "(same loss and gradients as separate rows).")
    # --- GRPO / DAPO -------------------------------------------------------------------------
    num_generations: int = setting(8, "Completions per prompt (G).")
    max_prompt_length: int = setting(512, "Prompts longer than this (in tokens) are left-truncated.")
    max_completion_length: int = setting(512, "New tokens per completion.")
    temperature: float = setting(1.0, "Rollout temperature (the loss uses the same temperature).")
    top_p: float = setting(1.0, "Rollout nucleus sampling.")
    top_k: int = setting(0, "Rollout top-k (0: off).")
    loss_type: str = setting("dapo", "grpo (sequence mean) | bnpo (token mean per micro-batch) | dapo (token mean, see "
                             "token_normalizer) | dr_grpo (sum / max length) | cispo (clipped IS weight without gradient x "
                             "logp, MiniMax-M1; token mean as dapo) | sapo (soft sigmoid gate instead of the clip, SAPO "
                             "arXiv 2511.20347; sequence mean) | luspo (sum over each completion's tokens, mean over "
                             "completions: GSPO scaled by length, LUSPO arXiv 2602.05261; use importance_sampling_level "
                             "sequence) | vespo (a smooth gamma weight of the completion's ratio x logp, VESPO arXiv "
                             "2602.10693; token level; token mean as dapo). Formulas: qerl.rl.loss.policy_loss.")
    token_normalizer: str = setting("generation", "dapo/cispo's token count when a generation feeds several optimizer "
                                    "updates: generation (the generation batch's tokens / its updates, TRL >= 1.9.2: every "
                                    "update weighs a token alike) | update (each update's own tokens). Same with one update.",
                                    choices=TOKEN_NORMALIZERS)
    importance_sampling_level: str = setting("token", "token (a ratio per token) | sequence (GSPO: exp of the completion's mean log-ratio, one per completion).")
    epsilon: float = setting(0.2, "Lower clip range of the ratio (unused by cispo).")
    delta: float | None = setting(None, "Two-sided clipping (INTELLECT-2, TRL's delta): also cap the unclipped ratio at "
                                  "this value (null: off; > 1 + epsilon_high).")
    sapo_temperature_pos: float = setting(1.0, "sapo: gate temperature for positive advantages (TRL's default).")
    sapo_temperature_neg: float = setting(1.05, "sapo: gate temperature for negative advantages (TRL's default).")
    vespo_k_pos: float = setting(2.0, "vespo: power k of the gamma weight for advantages >= 0 (TRL's default).")
    vespo_lambda_pos: float = setting(3.0, "vespo: decay lambda of the gamma weight for advantages >= 0 (TRL's default).")
    vespo_k_neg: float = setting(3.0, "vespo: power k for negative advantages (TRL's default).")
    vespo_lambda_neg: float = setting(2.0, "vespo: decay lambda for negative advantages (TRL's default).")
    epsilon_high: float | None = setting(0.28, "Upper clip range (DAPO clip-higher; null: same as epsilon). cispo: the cap of the IS weight itself (TRL recommends 5.0).")
    top_entropy_quantile: float = setting(1.0, "Train only on this fraction of tokens, those of highest entropy (TRL; 0.2 in the 80/20 paper; 1.0: all).")
    entropy_coef: float = setting(0.0, "Entropy bonus (TRL's): subtract coef x the mean per-token entropy over the tokens "
                                  "the policy term trains on, the same for every loss_type (0: off; old name "
                                  "entropy_coeff).")
    beta: float = setting(0.0, "KL coefficient against the base policy (adapters off); 0 as in DAPO.")
    use_bias_correction_kl: bool = setting(True, "Multiply the k3 KL term by the importance ratio (TRL's default, "
                                           "DeepSeek-V3.2: the unbiased reverse-KL gradient). Only with beta > 0.")
    scale_rewards: str = setting("group", "Advantage scaling: group (std per group; TRL's true) | batch (std of the batch) | "
                                 "none (TRL's false).", choices=SCALE_REWARDS)
    num_iterations: int = setting(1, "Policy updates per rollout batch (mu: 4 on GSM8K, 1 on BigMath in the paper).")
    mask_truncated_completions: bool = setting(False, "Leave completions cut at max_completion_length out of the loss.")
    dynamic_sampling: bool = setting(True, "DAPO: drop groups whose rewards are all equal and sample more prompts.")
    max_resample_rounds: int = setting(3, "Extra rollout rounds dynamic sampling may use to fill a step.")
    overlong_buffer_len: int = setting(0, "DAPO soft overlong penalty: length of the penalty ramp before the limit (0: off).")
    overlong_penalty_factor: float = setting(1.0, "DAPO soft overlong penalty at the limit.")
    importance_sampling_correction: bool = setting(False, "Weight the loss by pi_trainer / pi_rollout of the sampled "
                                                   "tokens, for the rollout engine's mismatch (TRL's "
                                                   "vllm_importance_sampling_correction; see importance_sampling_mode).")
    importance_sampling_mode: str = setting("sequence_mask", "token_truncate (per-token weights clipped to [cap_min, cap]) | "
                                            "token_mask (per-token weights outside it set to 0) | sequence_truncate (one "
                                            "weight a completion, exp of its summed log-ratio, clipped) | sequence_mask "
                                            "(completions whose weight is outside it dropped). TRL's "
                                            "vllm_importance_sampling_mode.", choices=IMPORTANCE_SAMPLING_MODES)
    importance_sampling_cap: float | None = setting(3.0, "Upper bound of the importance weights (TRL's "
                                                    "vllm_importance_sampling_clip_max; null: none).")
    importance_sampling_cap_min: float | None = setting(None, "Lower bound of the importance weights (TRL's "
                                                        "vllm_importance_sampling_clip_min; null: none).")
    off_policy_mask_threshold: float | None = setting(None, "DeepSeek-V3.2's off-policy sequence mask: drop completions with "
                                                      "a negative advantage whose mean KL(rollout || trainer) per token "
                                                      "exceeds this (e.g. 0.5; null: off).")
    reward_weights: list | None = setting(None, "Weights of the task's reward functions (null: all 1).", item=float)
    # --- AQN ---------------------------------------------------------------------------------
    aqn: bool = setting(True, "Adaptive Quantization Noise on the RMSNorm weights feeding q/k/v and gate/up.")
    aqn_schedule: str = setting("exponential", "exponential | linear | cosine | logarithmic decay of sigma over stages | adaptive (sigma follows aqn_adaptive_target within [aqn_sigma_end, aqn_sigma_start]).")
    aqn_stages: int = setting(10, "K stages evenly dividing max_steps (at most max_steps); stage 0 has sigma 0.")
    aqn_sigma_start: float = setting(1e-2, "sigma of stage 1.")
    aqn_sigma_end: float = setting(5e-4, "sigma of the last stage.")
    aqn_adaptive_signal: str = setting("entropy", "adaptive: the rollout signal sigma steers, entropy (mean token entropy) | zero_variance (fraction of groups whose rewards are all equal).")
    aqn_adaptive_target: float | None = setting(None, "adaptive: the signal's target (entropy in nats a token, or a "
                                                "fraction; null: the first step's measurement, held for the whole run).")
    aqn_adaptive_gain: float = setting(1.0, "adaptive: log sigma moves by gain x the relative error a step (at most x2 or /2).")
    aqn_in_training: bool = setting(False, "Also apply the step's noise in the training forward passes.")
    # --- evaluation (held-out pass@1 on the rollout engine) -----------------------------------
    eval_steps: int = setting(0, "Evaluate every N steps (0: only as eval_on_start / eval_on_end say).")
    eval_on_start: bool = setting(False, "Evaluate the untrained policy before the first step.")
    eval_on_end: bool = setting(False, "Evaluate after the last step.")
    eval_dataset_name: str | None = setting(None, "Evaluation set (a task name, file or hub dataset; null: the task's held-out split).")
    eval_dataset_config: dict = setting({}, "Options of the evaluation set (as dataset_config).")
    eval_limit: int | None = setting(None, "Evaluate on the first N problems (null: all).")
    eval_num_samples: int = setting(1, "Samples per problem; pass@1 is averaged over them.")
    eval_temperature: float = setting(0.6, "Evaluation temperature (the paper: 0.6).")
    eval_top_p: float = setting(0.95, "Evaluation nucleus sampling (the paper: 0.95).")
    eval_max_completion_length: int | None = setting(None, "New tokens per evaluation completion (null: max_completion_length).")
    # --- run ---------------------------------------------------------------------------------
    rollout_kv_cache_gb: float | None = setting(None, "KV-cache budget of the rollout engine (null: half the free GPU memory).")
    rollout_kv_cache_dtype: str = setting("auto", "KV cache of the rollout engine: auto (the model's dtype) | fp8 (E4M3 with "
                                          "per-slot, per-KV-head scales: half the bytes at long context; the engine-vs-"
                                          "trainer logprob mismatch grows, see importance_sampling_correction).")
    max_staleness: int = setting(0, "TRL's async GRPO name: how many adapter versions a rollout may lag behind the policy "
                                 "the update starts from. 0: the synchronous step (rollout, then update). 1: the rollout "
                                 "of step k+1 samples from adapter k (the engine's own copy) while step k's update makes "
                                 "adapter k+1, on a worker thread where it can; its logprobs are the update's old "
                                 "logprobs, so clipping and importance_sampling_correction apply as they are. Unlike TRL "
                                 "no sample is dropped: every batch lags by exactly min(step, max_staleness). At most 1.")
    # --- multi-turn tool use (GRPOTrainer(tools=...) or a task that carries tools) -------------
    max_turns: int = setting(4, "Tool turns per completion: generation stops at a tool call, the tool's output is "
                             "appended into the same sequence and decoding resumes, at most this many times.")
    tool_timeout_s: float = setting(5.0, "Wall time of one tool call; past it the model reads an error instead.")
    tool_max_output_chars: int = setting(2000, "Tool output longer than this is cut (with a note saying so).")
    parity_check_steps: int = setting(50, "Parity gate: at the start and every N steps, check on a fixed probe batch that the "
                                      "rollout engine's logprobs and adapter effect match the trainer's (0: off).")
    parity_max_logprob_diff: float | None = setting(0.1, "Parity gate: the largest mean |logprob difference| (nats) "
                                                    "accepted; past it training stops naming the side that diverged "
                                                    "(null: log only).")
    @property
    def entropy_coeff(self) -> float:
        """qerl's older name of entropy_coef (read-only)."""
        return self.entropy_coef

    def validate(self):
        """The shared fields' checks (TrainConfig.validate), then GRPO's own fields'."""
        TrainConfig.validate(self)

        def bad(name, msg):
            raise ValueError(f"config field '{name}': {msg}")

        if self.loss_type not in LOSS_TYPES:
            bad("loss_type", f"{self.loss_type!r} is not one of {LOSS_TYPES}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            bad("importance_sampling_level", f"{self.importance_sampling_level!r} is not one of {IMPORTANCE_SAMPLING_LEVELS}")
        if self.loss_type == "cispo" and (self.epsilon_high is None or self.epsilon_high < 1):
            bad("epsilon_high", f"{self.epsilon_high} with loss_type cispo: there it caps the IS weight itself, so it "
                "must be >= 1 (TRL recommends 5.0)")
        if not 0 < self.top_entropy_quantile <= 1:
            bad("top_entropy_quantile", f"must be in (0, 1], got {self.top_entropy_quantile}")
        if self.entropy_coeff < 0:
            bad("entropy_coeff", f"must be >= 0 (a bonus), got {self.entropy_coeff}")
        if self.scale_rewards not in SCALE_REWARDS:
            bad("scale_rewards", f"{self.scale_rewards!r} is not one of {SCALE_REWARDS}")
        if self.rollout_kv_cache_dtype not in ("auto", "fp8"):
            bad("rollout_kv_cache_dtype", f"{self.rollout_kv_cache_dtype!r} is not auto or fp8")
        if self.max_turns < 0:
            bad("max_turns", f"must be >= 0, got {self.max_turns}")
        if self.tool_timeout_s <= 0 or self.tool_max_output_chars < 1:
            bad("tool_timeout_s" if self.tool_timeout_s <= 0 else "tool_max_output_chars", "must be positive")
        if self.aqn_schedule not in AQN_SCHEDULES:
            bad("aqn_schedule", f"{self.aqn_schedule!r} is not one of {AQN_SCHEDULES}")
        if self.aqn_schedule == "adaptive":
            if self.aqn_adaptive_signal not in ("entropy", "zero_variance"):
                bad("aqn_adaptive_signal", f"{self.aqn_adaptive_signal!r} is not entropy or zero_variance")
            if not 0 < self.aqn_sigma_end <= self.aqn_sigma_start:
                bad("aqn_sigma_end", "adaptive AQN keeps sigma in [aqn_sigma_end, aqn_sigma_start]: need 0 < end <= start")
            if self.aqn_adaptive_gain < 0:
                bad("aqn_adaptive_gain", f"must be >= 0, got {self.aqn_adaptive_gain}")
        if self.num_generations < 2:
            bad("num_generations", "group-relative advantages need at least 2 completions per prompt")
        for name in ("num_iterations", "max_completion_length", "aqn_stages"):
            if getattr(self, name) < 1:
                bad(name, f"must be >= 1, got {getattr(self, name)}")
        for name in ("generation_batch_size", "steps_per_generation"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                bad(name, f"must be >= 1 (or null), got {getattr(self, name)}")
        from .batch_sizes import batch_plan

        batch_plan(self, world=1)  # the batch must split on one process; the trainer checks its world size
        if self.parity_check_steps < 0:
            bad("parity_check_steps", f"must be >= 0, got {self.parity_check_steps}")
        if self.eval_steps < 0:
            bad("eval_steps", f"must be >= 0, got {self.eval_steps}")
        if self.eval_num_samples < 1:
            bad("eval_num_samples", f"must be >= 1, got {self.eval_num_samples}")
        from .config_checks import check_inputs, check_ranges  # dataset options (issue 22)

        check_inputs(self)
        check_ranges(self)  # every numeric GRPO field's range (issue 34)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per step on one process (each of W ranks makes 1/W of them)."""
        from .batch_sizes import batch_plan

        return self.num_iterations * batch_plan(self, world=1).updates_per_rank

    # ---- files and command lines (TrainConfig's, with TRL's aliases) ------------------------
    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "GRPOConfig":
        return typed(cls, resolve_aliases(d, source), source)

    def with_overrides(self, pairs: dict[str, str]) -> "GRPOConfig":
        """CLI overrides by field name; values parse as YAML scalars (1e-5, true, null, [q, v])."""
        d = self.to_dict()
        pairs = {FIELD_ALIASES.get(k, k): v for k, v in pairs.items()}
        for k, v in pairs.items():
            d[k] = parse_value(k, v, type(self))
        # both size a step (TRL: set one): one given here replaces a base config's setting of the other
        for a, b in (("generation_batch_size", "steps_per_generation"), ("steps_per_generation", "generation_batch_size")):
            if a in pairs and b not in pairs:
                d[b] = None
        return type(self).from_dict(d, source="command line")


def resolve_aliases(d: dict, source: str) -> dict:
    """`d` with TRL's (and qerl's older) field names replaced by qerl's (both names of one field with two values
    is an error) and TRL's fields that qerl has none for sorted out by train/trl_fields.py's rule: without an effect,
    or at TRL's default, named in one line; another value of one that would change training refused by name."""
    import dataclasses

    from ..train.trl_fields import sort_out

    d = sort_out(d, "grpo", {f.name for f in dataclasses.fields(GRPOConfig)} | set(FIELD_ALIASES), source)
    out = {}
    for k, v in d.items():
        name = FIELD_ALIASES.get(k, k)
        if name in out and None not in (v, out[name]) and v != out[name]:
            raise ValueError(f"{source}: field '{name}' is given twice (also as '{k}', its alias)")
        if name not in out or out[name] is None:  # one name at None (TRL's deprecated one's default): the other's
            out[name] = v
    return out


_dataclass_init = GRPOConfig.__init__


def _init_with_aliases(self, *args, **kw):
    _dataclass_init(self, *args, **resolve_aliases(kw, "GRPOConfig"))


_init_with_aliases.__wrapped__ = _dataclass_init  # GRPOConfig(vllm_importance_sampling_mode=...) as in TRL
GRPOConfig.__init__ = _init_with_aliases
