"""The quantization-noise study (issue 10): does NVFP4 (and AQN) help RL exploration at small scale?

    qerl study run [--losses dapo,grpo] [--arms ...] [--seeds 0,1,2] [--parallel 8] [--out runs/study]
    qerl study report [--out runs/study] [--doc docs/study.md]

Every arm is the embedded default run (SmolLM2-135M-Instruct, LoRA r32, reasoning-gym chain
sums, held-out pass@1 before and after) with one thing changed: the base format, AQN, or the
learning rate. Same data order, steps and seeds for all arms; no arm is tuned on its own: the
common learning rate is the default run's, and bf16 also runs at the paper's two bf16 rates.
"""

from __future__ import annotations

COMMON_LR = 5e-5  # the default run's rate (chosen on the NVFP4 + AQN default run: see docs/study.md)

# name -> (description, qerl train overrides)
ARMS = {
    "bf16": ("bf16 LoRA", {"quant": "bf16", "aqn": False}),
    "bf16_lr1e-5": ("bf16 LoRA, lr 1e-5 (paper)", {"quant": "bf16", "aqn": False, "learning_rate": 1e-5}),
    "bf16_lr5e-6": ("bf16 LoRA, lr 5e-6 (paper)", {"quant": "bf16", "aqn": False, "learning_rate": 5e-6}),
    "bf16_aqn": ("bf16 LoRA + AQN (noise, no quantization)", {"quant": "bf16", "aqn": True}),
    "nvfp4": ("NVFP4 LoRA", {"quant": "nvfp4", "aqn": False}),
    "nvfp4_aqn": ("NVFP4 LoRA + AQN (QeRL)", {"quant": "nvfp4", "aqn": True}),
    # closed-loop AQN (issue 24): sigma holds the rollout entropy at its first step's level, untuned
    "nvfp4_aqn_adaptive": ("NVFP4 LoRA + closed-loop AQN (entropy held at its start)",
                           {"quant": "nvfp4", "aqn": True, "aqn_schedule": "adaptive"}),
    "mxfp4": ("MXFP4 LoRA", {"quant": "mxfp4", "aqn": False}),
    "nf4": ("NF4 LoRA (QLoRA)", {"quant": "nf4", "aqn": False}),
}

LOSSES = {
    "dapo": {"loss_type": "dapo", "dynamic_sampling": True, "epsilon_high": 0.28},
    "grpo": {"loss_type": "grpo", "dynamic_sampling": False, "epsilon_high": None},
}
