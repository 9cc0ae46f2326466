"""Every kernel choice in one object: `KernelSettings`, in force for a scope (`use`) and read where a
choice is made (`current`).

Before, each switch was a module global of its own (dispatch's enable flag and FOLD_AND_PACK, the
layers' fused-LoRA and fused-training stacks, the Triton PTX decode, the wgmma gate), set by tests,
benches and the trainer in place. Now a caller says what it wants for the duration of its work:

    with settings.use(fuse_lora=False):   # e.g. PPO's old-policy pass on the training path
        ...

The object in force lives in a ContextVar: a scope's changes end with it (exceptions included), and
threads do not see each other's (a thread starts from the defaults): a rollout thread and an update
running at once each keep their own choices. The engine and trainer take a KernelSettings and enter
it around their work.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KernelSettings:
    kernels: bool = True
    """Use the GPU kernel backends (False: the plain-torch dequantize-and-multiply path, for tests and A/B)."""
    wgmma: bool = True
    """Route M = w4_wgmma.ROUTE_MIN_M..MAX_M tokens to the Hopper wgmma kernel (sm_90a only; its GPU tests,
    tests/test_w4_wgmma_gpu.py, passed on an H100 and H200, and it beat mma.sync from M = 64: w4_wgmma.py)."""
    humming: bool = True
    """Let the routes table (kernels/routes.py: the fastest kernel per M and weight shape, measured on this card)
    send weights in qerl's layout to humming-kernels' kernels where it imports (pyproject's `cuda` extra), on a copy
    of the weight made when the model loads if it fits (humming_backend.plan_copies). False: qerl's own kernels by
    routes.DEFAULT (mma.sync, wgmma, dequantize + cuBLAS)."""
    humming_deterministic: bool = True
    """Route by the card's repeatable list: every kernel in it gives the same bits for the same inputs at the same
    M, every call, eager or from a graph, on any stream (seeded rollouts repeat; graphs equal eager steps). False:
    the stream-K list, which may also name humming's own stream-K (`humming_sk`), whose partial sums land in
    arrival order: other bits each call (benchmarks/kernels.md). The record says what each list costs."""
    humming_storage: bool = False
    """Load NVFP4 weights in humming-kernels' layout (formats/nvfp4_humming.py) where humming runs: one copy,
    read by humming at every M and dequantized from for the backward, instead of qerl's MMA layout plus a
    humming copy for the M buckets it serves. Read when a model loads (kernels.storage_format). Off by default:
    a memory option (one copy instead of two: 14.08 against 16.17 GiB in the H100 7B GRPO step), not a speed path. With
    batch-invariant humming (`humming_deterministic`) it is slower than qerl's own kernels at every M (H100: the
    7B rollout at batch 1 ran 121 against 262 tok/s): pair it with humming_deterministic=False."""
    lora_expand_kernel: bool = True
    """Beside a library GEMM (humming), a fused group's LoRA expand runs as one Triton launch for all its segments
    (kernels/lora_expand.py; False: one cuBLAS addmm per segment, the A/B baseline of `bench kernels`)."""
    lora_overlap: bool = False
    """Beside humming (dense, split-K or stored), a layer's LoRA shrink runs on a side stream while the base GEMM
    runs, joined before the expand (kernels/lora_shrink.begin/finish): the same kernels and bits, the shrink's
    launches hidden. H100 at c5576bc (bench kernels, 7B layer set): 5-15 % less LoRA time than the shrink first
    (humming_lora32_overlap against humming_lora32). Off by default until the rollout's GPU tests (CUDA graphs)
    have run with it on; False: the shrink first, on the same stream."""
    lora_shrink_split: bool = True
    """A LoRA shrink that is not fused into the base kernel runs as one split-K Triton launch where the measured
    table routes its M (kernels/lora_shrink.py `split_routes`, M 2-64 now; False: the one-row-a-program decode
    kernel where it applies, else cuBLAS)."""
    fuse_lora: bool = True
    """No-grad forwards fuse the LoRA expand into the base kernel's epilogue (False: the training path's
    separate LoRA term, so a no-grad logprob pass gives the grad-enabled pass's bits: PPO's old policy)."""
    train_fused: bool = True
    """Fused groups (q|k|v, gate|up) train as one matmul (False: member by member, the reference)."""
    fold_and_pack: bool = True
    """CPU rollouts: fold unshrunk adapters into the cached dequantized weights and pack them for oneDNN."""
    ptx_decode: bool = True
    """The Triton kernels decode NVFP4/MXFP4 with inline PTX for bf16 (False: the portable decode)."""
    moe_route_counting: bool = True
    """Where the one-launch route (moe_route_fused) is off or out of its bounds, MoE decode sorts its token-expert
    pairs by a counting sort (kernels/moe_gemv._route_counting: no argsort;
    the same routing bit for bit, tests/test_moe_route.py) instead of two argsorts (False). The H100 profile put
    the argsort version at 81 µs and 36 launches a Qwen3-30B-A3B layer at 64 sequences, a radix sort 27 µs of it.
    H100 at 9b635f0, one GRPO step each (`qerl bench step`, 8x8, 256 new): rollout 1.08x on Qwen3-30B-A3B
    (2707 against 2507 tok/s, mb 8) and 1.03x on gpt-oss-20b (2879 against 2788, mb 4); its CUDA-graph test
    against HF generate passed on both (tests/test_moe_gpu.py, H100, 700f1db)."""
    moe_route_fused: bool = True
    """MoE decode builds its routing in one Triton launch (kernels/moe_route.py, bit-equal to the counting sort)
    instead of the counting sort's 18 torch ops (False). H100 at daff6d8, from CUDA graphs (`qerl bench moe
    --route`, top-8 of 128 experts): 4.1 µs against 40.6 (counting) and 70.5 (argsorts) at 64 tokens, 2.6 against
    31.1 at 1; its GPU tests (bit-equal to the counting sort, a graph replay) passed there."""
    moe_grouped: bool = True
    """MoE forwards on CUDA (`kernels` on) take QuantExperts' grouped path: tokens sorted by expert, the hit
    experts dequantized a chunk at a time in one launch (kernels/moe_dequant.py), one torch._grouped_mm per
    projection (False: transformers' loop, one dequantize and matmul per hit expert). H100, one Qwen3-30B-A3B
    expert layer at 2048 tokens: 4.7 ms against the loop's 94.8 (`qerl bench moe`, 2026-12-06).
    A module's own `grouped` (True/False) overrides this."""
    moe_expert_chunk_mib: int | None = None
    """The grouped path dequantizes as many hit experts at once as fit this many MiB (the larger projection's
    weights, in the activations' dtype) instead of QuantExperts.expert_chunk (16). A training micro-batch hits
    every expert, and each chunk costs its own launches and host syncs: a Qwen3-30B-A3B layer's 128 experts take
    8 chunks at 16, 1 at 1024 MiB (805 MB of bf16 gate|up weights, freed after each matmul); on the CPU, with the
    dequantize as one op, a 128-expert forward issues 266 non-view ops at 16 a chunk and 42 at 128, the backward
    306 and 40. Its chunks' bounds come from one read of the counts, not two host syncs a chunk. The H200
    profile of the update (b8030c1) found the GPU busy 28 % of the time. Measured, it is not a speed path: H100 at
    700f1db, the Qwen3-30B-A3B step at mb 8 with 1024 MiB took 30.5 s against 20.3 (update 17.5 against 11.0,
    logprob 7.0 against 2.6). It stays as a memory option: a small budget bounds the dequantized chunk below 16
    experts (gpt-oss-20b's 14 GiB step runs at 128 MiB: docs/moe-24gb.md). None: 16 experts a chunk."""
    moe_gemv: bool = True
    """No-grad MoE forwards of few tokens (CUDA, T <= moe_gemv.MAX_TOKENS, `kernels` on) run each expert
    projection as one grouped 4-bit GEMV over the hit experts (kernels/moe_gemv.py) instead of dequantizing
    each hit expert. H100, one Qwen3-30B-A3B expert layer: 0.86 / 0.69 / 0.98 ms at 1 / 8 / 64 tokens against
    the loop's 6.2 / 34.4 / 102.4 (its GPU tests against a float64 reference pass)."""

_CURRENT: ContextVar[KernelSettings] = ContextVar("qerl_kernel_settings", default=KernelSettings())


def current() -> KernelSettings:
    """The settings in force here (this thread, this scope)."""
    return _CURRENT.get()


@contextlib.contextmanager
def use(settings: KernelSettings | None = None, **changes):
    """Put `settings` (default: the current ones) with `changes` applied in force until the block ends."""
    token = _CURRENT.set(replace(settings or current(), **changes))
    try:
        yield current()
    finally:
        _CURRENT.reset(token)
