"""The embedded default run: what `qerl train` does with no arguments.

SmolLM2-135M-Instruct (offline, converted once and cached) in NVFP4 with a rank-32 LoRA and
AQN, trained with DAPO on a reasoning-gym task (sums of two terms of one or two digits), with
held-out pass@1 before and after. The untrained model starts near zero (~3 %) but not at it,
so GRPO groups carry signal from the first step, and it learns the task within the budget (on
a validation draw: ~3 % -> ~29 % in 36 steps). The CPU settings fit in 10 minutes on two cores
(bf16 where the CPU has it natively, else fp32 and fewer steps); a GPU gets a larger budget
(more prompts a step, more steps, 4 samples per held-out problem), with the same code.
"""

from __future__ import annotations

from .config import GRPOConfig

# two terms of 1-2 digits (issue 42, chosen on the validation draw: benchmarks/default_run.md, settings 11);
# single-digit pairs are too few (~200) for a held-out split disjoint from 1000 training problems
TASK = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "size": 1000, "eval_size": 200,
        "instruction": "\nGive only the final number."}

# what fits ~10 minutes on two cores with both evaluations: ~15 s a step while completions are ~30 tokens,
# ~9 s once they shrink to the bare number (480 s for 36 steps on the validation draw); fp32 steps ~1.3x dearer
STEPS_BF16, STEPS_FP32 = 36, 28

CPU = dict(
    model_name_or_path="smollm2", quant="nvfp4", lora_r=32, lora_alpha=64.0,
    dataset_name="rg:chain_sum", dataset_config=TASK,
    # 8 prompts a step at lr 1e-4: on the validation draw this shape gained about as much per completion
    # as the GPU's 16 prompts (benchmarks/default_run.md, tuning); CPU rollouts got ~1.8x cheaper
    # (folded adapters, packed weights), which buys the larger step
    max_prompt_length=128, learning_rate=1e-4, max_steps=STEPS_BF16, num_generations=8,
    # the step's 64 completions train as 4 micro-batches of 16 (2 prompts' groups) accumulated into one update:
    # the same gradient (dapo sums tokens over the update), a quarter of the activations (issue 50: one
    # micro-batch of 64 kept ~4 GiB of fp32 activations, the run peaked at 7.3 GiB RSS)
    per_device_train_batch_size=16, gradient_accumulation_steps=4,
    # the head's logprobs 128 tokens at a time: each chunk's fp32 logits, softmax and gradient over the 49k
    # vocabulary are ~25 MB apiece (the planner's smallest, 256, twice that), the same numbers
    logprob_chunk_size=128,
    max_completion_length=48, temperature=1.0, loss_type="dapo", dynamic_sampling=True, max_resample_rounds=1,
    aqn=True, aqn_stages=5, aqn_sigma_start=1e-2, aqn_sigma_end=5e-4,
    eval_on_start=True, eval_on_end=True, eval_limit=200, eval_num_samples=2, eval_temperature=0.6, eval_top_p=0.95,
    # the rollout engine's KV cache: 75 sequences of 177 tokens in fp32, 150 in bf16 (the trainer's CPU default of
    # 2 GiB held 256 fp32 slots, resident from the start: the evaluation alone peaked at 3.7 GiB RSS). A rollout's
    # 64 completions fit at once; the 400 held-out ones take more rounds of a batch that costs ~linearly in its
    # size on two cores
    rollout_kv_cache_gb=0.6,
    # a checkpoint every 6 steps (the adapter and its optimizer state: a few MB, well under a second): an
    # interrupt late in the run loses at most 5 steps, and `qerl train --resume runs/default` continues it
    output_dir="runs/default", save_steps=6, save_total_limit=1, optim="adamw_torch",
    steps_per_generation=4,  # one update a step of 4 x 16 = 64 completions (TRL's semantics)
    # the parity gate's start-of-run check costs ~40 s on two cores (two steps' worth of a 13-minute
    # budget); the GPU run keeps it, and `--parity_check_steps 50` turns it on here
    parity_check_steps=0,
    # bf16 where the CPU multiplies it natively (AVX512-BF16, AMX): on the 2-core EPYC the matmuls run
    # 1.3-2.5x faster than fp32 and a step ~1.35x, so more steps fit the budget (see default_run_config)
    dtype="bfloat16",
    # ... with the LoRA factors kept in fp32: at lr 5e-5 Adam's steps are far below bf16's spacing at A's
    # magnitude (~0.04 -> ~2e-4) and round away (tests/test_lora_dtype.py)
    lora_dtype="float32",
)

# Chosen on a validation draw of the task (generator seed 7, never the held-out set below;
# benchmarks/default_run.md "tuning"): 16 prompts a step at lr 1e-4 learned fastest per step.
GPU = dict(CPU, max_steps=60, per_device_train_batch_size=128, gradient_accumulation_steps=1, steps_per_generation=1,
           learning_rate=1e-4, eval_num_samples=4,
           optim="adamw_8bit", parity_check_steps=50, dtype="auto", lora_dtype="auto",
           rollout_kv_cache_gb=None, logprob_chunk_size=None)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX); elsewhere torch emulates
    bf16 matmuls and they are slower than fp32's."""
    import torch

    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without these probes
        return False


def default_run_config(device: str | None = None) -> GRPOConfig:
    """The default run's settings for `device` (None: cuda when available)."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda"):
        return GRPOConfig(**GPU)
    if cpu_has_fast_bf16():
        return GRPOConfig(**CPU)
    return GRPOConfig(**dict(CPU, dtype="float32", max_steps=STEPS_FP32))
