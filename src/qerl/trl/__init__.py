"""TRL's API over qerl: a script written for TRL runs with only its import line changed,

    from trl import GRPOConfig, GRPOTrainer        ->        from qerl.trl import GRPOConfig, GRPOTrainer
    from trl import SFTConfig, SFTTrainer          ->        from qerl.trl import SFTConfig, SFTTrainer

One module an idea: grpo.py and sft.py (the configs and trainers), surface.py (what a script calls
around train()), steps.py (TRL's step semantics), rewards as TRL calls them (qerl/rl/rewards.py),
reward_models.py, prompts.py (prompt lengths), completions.py (log_completions), lora.py (peft_config),
data.py (datasets and models). TRL's config fields (those the surface reads, renamed, or that qerl lacks:
ignored, taken at TRL's default, or refused) are qerl/train/trl_fields.py's, outside this package: the core
configs read them too, and importing this package brings the trainers.
README.md, "Coming from TRL", lists the defaults that differ from TRL's and why.
"""

from .grpo import GRPOConfig, GRPOTrainer
from .sft import SFTConfig, SFTTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "SFTConfig", "SFTTrainer"]
