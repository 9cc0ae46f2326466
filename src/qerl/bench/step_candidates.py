"""Settings for one MoE GRPO step under a memory target, ranked: the memory model's levers over a grid
(`qerl bench memory --step-only --candidates`). A candidate is a prediction until `qerl bench step` runs it.

Kept: predicted peak reserved <= target - margin (the margin covers the model's out-of-sample error: the
largest under-prediction of a comparable step is gpt-oss-20b's -0.88 GiB, bench/memory_fit.py). Ranked by
what the step's time depends on: rollout waves (64 rows through fewer KV slots decode in more rounds), then
micro-batch (packed: 2 completions share their prompt's tokens), then the logprob chunk, then the predicted
peak. The optimizer is the one asked for (bench step's default, adamw_8bit, where bitsandbytes runs). A candidate
runs under the target as its memory cap (step_command), so it is predicted with the capped slack
(StepSettings.memory_cap_gb; Allowances.capped_slack).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from .step_plan import BF16, GIB, MoEShape, StepSettings, expert_shapes, plan_step

KV_GB = (0.25, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2)
MICRO_BATCH = (1, 2)
# No chunk under 128: on the GPU 512 -> 128 gave much less than the model's 1.06 GiB (the 24 GB settings run peaked
# at 22.23 GiB reserved, its capped run reached 21.73 allocated; the model says 21.91 / 20.79), so a candidate
# should not lean on the chunk further than a run has gone
LOGPROB_CHUNK = (128, 256, 1024)
KV_BYTES = (2, 1)  # bf16, fp8 (GRPOConfig.rollout_kv_cache_dtype; `qerl bench step --kv-cache-dtype fp8`)


@dataclass(frozen=True)
class Candidate:
    settings: StepSettings
    peak_gib: float
    slots: int

    @property
    def waves(self) -> int:
        return -(-self.settings.rows // self.slots) if self.slots else 0



def candidates(shape: MoEShape, base: StepSettings, target_gib: float, margin_gib: float) -> list[Candidate]:
    out = []
    for kv, kvb, mb, chunk in itertools.product(KV_GB, KV_BYTES, MICRO_BATCH, LOGPROB_CHUNK):
        st = replace(base, kv_cache_gb=kv, kv_bytes=kvb, micro_batch=mb, logprob_chunk=chunk, memory_cap_gb=target_gib)
        p = plan_step(shape, st)
        if p.kv_slots and p.peak_reserved / GIB <= target_gib - margin_gib:
            out.append(Candidate(st, p.peak_reserved / GIB, p.kv_slots))
    # the step's time: fewer rollout waves, then the larger micro-batch, then the larger chunk
    return sorted(out, key=lambda c: (c.waves, -c.settings.micro_batch, -c.settings.logprob_chunk, c.peak_gib))


def step_command(shape: MoEShape, st: StepSettings) -> str:
    """The `python -m qerl.bench.step` line that runs a candidate under its cap (scripts/device.sh step_moe's flags)."""
    parts = [f"python -m qerl.bench.step --shape {shape.name} --prompts {st.prompts} "
             f"--num-generations {st.rows // st.prompts} --prompt-len {st.prompt_len} --max-new-tokens {st.new_tokens} "
             f"--micro-batch {st.micro_batch} --steps 1 --optim {st.optim} --kv-cache-gb {st.kv_cache_gb:g} "
             f"--logprob-chunk {st.logprob_chunk}"]
    if st.kv_bytes == 1:
        parts.append("--kv-cache-dtype fp8")
    if not st.humming:
        parts.append("--no-humming")
    if st.humming_storage:
        parts.append("--humming-storage")
    if st.expert_chunk != StepSettings().expert_chunk:  # bench step budgets chunks in MiB of bf16 weights
        mib = -(-st.expert_chunk * max(o * i for o, i in expert_shapes(shape)) * BF16 // 2**20)
        parts.append(f"--expert-chunk-mib {mib}")
    if st.embed_4bit:
        parts.append("--embed-4bit")
    if st.memory_cap_gb is not None:
        parts.append(f"--memory-cap-gb {st.memory_cap_gb:g}")
    parts.append("--record")
    return " ".join(parts)
