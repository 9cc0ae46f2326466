"""Projected GPU memory of one GRPO step for MoE shapes (Qwen3-30B-A3B, gpt-oss-20b/120b): computed,
not measured.

What a step holds at its peak: the frozen weights (attention NVFP4, experts NVFP4 or gpt-oss's own
MXFP4, embeddings / lm_head / routers / norms in bf16), the LoRA factors with their gradients and
optimizer state, the rollout's KV cache (allocated once, kept through the update), and the larger of
the rollout's and the update's working memory (the update with gradient checkpointing: each layer's
input kept, one layer recomputed at a time, the logits chunked). Quantized bytes come from the
formats' own tensor shapes (`WeightFormat.nbytes`), so they are what the loader allocates; the
working sets are counted from the code's tensors, and two allowances (`Allowances`: a residual no term
accounts for, and the caching allocator's slack) are read off ONE measured step (`fit_allowances`; by default
FIT_RECORD), the slack of a run under a memory cap off ONE capped step (`with_capped_slack`; CAPPED_FIT_RECORD),
so every other measured step is an out-of-sample check (`qerl bench memory --fit-on ... --predict
...`, bench/memory_fit.py). The figures are projections; `qerl bench step --shape qwen3-30b-a3b` (or gpt-oss-20b
/ 120b) builds the shape with random weights on a GPU and measures a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ..formats import get_format

BF16 = 2
GIB = 2**30


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    top_k: int
    expert_intermediate: int
    expert_format: str            # nvfp4 (quantized by qerl) | mxfp4 (gpt-oss's checkpoint bytes)
    attention_bias: bool = False
    expert_bias: bool = False
    tied_embeddings: bool = False
    qk_norm: bool = False         # q/k RMSNorms of one head's width (Qwen3)
    sinks: bool = False           # a learned sink logit per head (gpt-oss)
    # the update packs a micro-batch's completions behind one prompt (train/packing.py); a family with
    # sliding-window layers trains on padded rows instead (packing.has_sliding_window: gpt-oss). Not part of
    # the shape's identity (compare=False): it is read from the family, not the config's sizes
    packed: bool = field(default=True, compare=False)

    @classmethod
    def of(cls, name: str, config) -> "MoEShape":
        """The planner's description of an MoE config, its facts read through its family (model/family.py):
        the experts' count, width, biases and checkpoint format, q/k norms, sinks."""
        from ..model.family import family_of_config

        fam = family_of_config(config, name)
        ex = fam.experts
        return cls(name, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                   config.num_key_value_heads, config.head_dim, config.vocab_size, getattr(config, ex.count),
                   config.num_experts_per_tok, getattr(config, ex.intermediate), ex.checkpoint_format or "nvfp4",
                   bool(getattr(config, "attention_bias", False)), ex.bias, bool(config.tie_word_embeddings),
                   fam.qk_norm == "head", fam.sinks, packed=all(w is None for w in fam.windows(config)))


def _moe_shapes() -> dict[str, MoEShape]:
    """The real MoE shapes, from the configs the random builder makes (model/random_init.py's MOE)."""
    from ..model.random_init import moe_config

    return {n: MoEShape.of(n, moe_config(n)) for n in ("qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b")}


MOE_SHAPES = _moe_shapes()


@dataclass(frozen=True)
class StepSettings:
    """One GRPO step's settings, as `qerl bench step` takes them (defaults: the calibrated H100 step)."""
    rows: int = 64                # prompts x generations in one step (8 x 8)
    prompts: int = 8              # distinct prompts: the engine prefills each once for its generations
    prompt_len: int = 256
    new_tokens: int = 256
    kv_cache_gb: float | None = 3.4  # the rollout KV budget (GiB, --kv-cache-gb); None: kv_rows slots
    kv_rows: int = 64             # slots when kv_cache_gb is None
    kv_bytes: int = 2             # per cached value: 2 (auto: the model's bf16) or 1 (fp8)
    micro_batch: int = 2          # completions per forward/backward (packed: their prompt once)
    logprob_chunk: int = 1024     # completion tokens whose logits exist at once in the update
    lora_rank: int = 32           # on attention (q, k, v, o); LoRA on experts is off unless targeted
    lora_dtype: str = "auto"      # auto (bf16 factors) | float32 (bf16 factors + fp32 master copies)
    optim: str = "adamw_torch"    # adamw_torch | adamw_8bit (bitsandbytes)
    prefill_chunk: int = 2048     # the engine's prefill chunk (tokens)
    expert_chunk: int = 16        # experts dequantized at once by the grouped path (QuantExperts.expert_chunk),
                                  # made again in the backward rather than saved (layers/grouped_mm.py)
    expert_inputs_kept: bool = False  # True: the code before the fix, whose grouped frozen matmul kept a closure over
                                  # its input until the backward (ctx attributes escape checkpointing), so every
                                  # layer's expert inputs lived through the update; the records measured then
                                  # (memory_fit.KEPT_INPUTS) are read with it
    humming: bool = True          # KernelSettings.humming: a humming-kernels copy of each attention weight it
                                  # takes (the H100's routes send M > 16 to it); off, or on a card where the
                                  # copy would leave < KEEP_FREE of it free (a 24 GB card), no copy is made
    humming_storage: bool = False  # KernelSettings.humming_storage: the attention weights it takes stored in
                                  # humming's layout (formats/nvfp4_humming.py), so humming needs no copies
    embed_4bit: bool = False      # TrainConfig.embed_4bit: the input embedding in NVFP4 (layers/quant_embed.py)
    memory_cap_gb: float | None = None  # `qerl bench step --memory-cap-gb`: moves no term, picks the allocator's slack
                                  # (Allowances.capped_slack: under a cap it reserves much less over its peak)
    runtime_bytes: int = GIB // 2  # CUDA context and libraries: outside torch's count (not in peak_reserved)

    @property
    def kv_budget(self) -> int | None:
        return None if self.kv_cache_gb is None else int(self.kv_cache_gb * GIB)


@dataclass(frozen=True)
class StepMemory:
    """Bytes by what holds them. peak_allocated: what torch's allocator counts at the step's peak (the
    persistent terms, the larger phase's working set and the fitted residual); peak_reserved adds the
    allocator's fitted slack, and `peak` is peak_reserved (what a card must have free besides the CUDA
    context, `runtime`)."""
    experts: int
    attention: int
    dense: int                    # embeddings, lm_head, routers, norms, sinks, biases
    kernel_copies: int            # humming-kernels copies of attention weights
    lora_and_optimizer: int       # LoRA factors, their gradients and optimizer state
    kv_cache: int
    rollout_working: int
    update_working: int
    residual: int                 # Allowances.residual (fitted on one measured step)
    allocator_slack: int          # Allowances.slack, or its capped_slack under a memory cap (slack_for)
    runtime: int                  # outside torch's count
    kv_slots: int = 0

    @property
    def weights(self) -> int:
        return self.experts + self.attention + self.dense

    @property
    def peak_allocated(self) -> int:
        return (self.weights + self.kernel_copies + self.lora_and_optimizer + self.kv_cache + self.residual
                + max(self.rollout_working, self.update_working))

    @property
    def peak_reserved(self) -> int:
        return self.peak_allocated + self.allocator_slack

    @property
    def peak(self) -> int:
        return self.peak_reserved

    def gib(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) / GIB for f in fields(self) if f.name != "kv_slots"}
        out.update(weights=self.weights / GIB, peak_allocated=self.peak_allocated / GIB,
                   peak_reserved=self.peak_reserved / GIB, peak=self.peak / GIB, kv_slots=self.kv_slots)
        return out


def attention_shapes(s: MoEShape) -> list[tuple[int, int]]:
    """[out, in] of q, k, v, o."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return [(q, s.hidden), (kv, s.hidden), (kv, s.hidden), (s.hidden, q)]


def expert_shapes(s: MoEShape) -> list[tuple[int, int]]:
    """[out, in] of one expert's gate|up and down."""
    return [(2 * s.expert_intermediate, s.hidden), (s.hidden, s.expert_intermediate)]


def parameter_counts(s: MoEShape) -> dict[str, int]:
    """Parameters by kind, as transformers builds the model."""
    attn = sum(o * i for o, i in attention_shapes(s))
    attn_bias = sum(o for o, _ in attention_shapes(s)) if s.attention_bias else 0
    experts = s.experts * sum(o * i for o, i in expert_shapes(s))
    expert_bias = s.experts * sum(o for o, _ in expert_shapes(s)) if s.expert_bias else 0
    router = s.experts * s.hidden + (s.experts if s.expert_bias else 0)
    norms = 2 * s.hidden + (2 * s.head_dim if s.qk_norm else 0)
    sinks = s.heads if s.sinks else 0
    per_layer_dense = attn_bias + expert_bias + router + norms + sinks
    embed = s.vocab * s.hidden * (1 if s.tied_embeddings else 2)
    return {"attention": attn * s.layers, "experts": experts * s.layers,
            "dense": per_layer_dense * s.layers + embed + s.hidden}


def humming_copy_shapes(s: MoEShape) -> list[tuple[int, int]]:
    """The attention weights humming takes, as the layers hold them: q|k|v fused into one weight, and o;
    humming_backend.supports_shape: N a multiple of 128, K of 32."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return [(n, k) for n, k in ((q + 2 * kv, s.hidden), (s.hidden, q)) if n % 128 == 0 and k % 32 == 0]


def kv_slot_bytes(s: MoEShape, st: StepSettings) -> int:
    """One slot of the rollout cache (rollout/kv_cache.py bytes_per_slot): K and V of every layer for
    prompt + 1 + new tokens, plus fp8's per-(slot, head) fp32 scales."""
    max_len = st.prompt_len + 1 + st.new_tokens
    scales = 2 * s.layers * s.kv_heads * 4 if st.kv_bytes == 1 else 0
    return 2 * s.layers * s.kv_heads * max_len * s.head_dim * st.kv_bytes + scales


def kv_slots(s: MoEShape, st: StepSettings) -> int:
    """Slots the engine makes (kv_cache.slots_for_budget): the budget's whole slots, at most the step's rows."""
    if st.kv_budget is None:
        return min(st.kv_rows, st.rows)
    return max(0, min(st.kv_budget // kv_slot_bytes(s, st), st.rows))


def lora_bytes(s: MoEShape, st: StepSettings) -> int:
    """LoRA factors on q, k, v, o with gradients and optimizer state. Factors and gradients in bf16 (auto);
    lora_dtype float32 adds fp32 master copies and their fp32 gradients (train/optim.py) and the optimizer
    state follows the masters. AdamW keeps two moments in the stepped tensors' dtype (adamw_torch) or in
    8 bits (bitsandbytes' blockwise: 1 byte + a fp32 absmax per 256)."""
    n = s.layers * st.lora_rank * sum(o + i for o, i in attention_shapes(s))
    master = st.lora_dtype == "float32"
    moment = (1 + 4 / 256) if st.optim == "adamw_8bit" else (4 if master else BF16)
    return int(n * (BF16 + BF16 + (8 if master else 0) + 2 * moment))


def packed_tokens(st: StepSettings) -> int:
    """Tokens of one packed micro-batch (train/packing.py): the prompt once, each completion, padded to
    FlexAttention's 128-token blocks."""
    t = st.prompt_len + st.micro_batch * st.new_tokens
    return -(-t // 128) * 128


def update_tokens(s: MoEShape, st: StepSettings) -> int:
    """Tokens one micro-batch runs through the model in the update: packed, or padded rows (each its prompt
    and completion; train/batch.py pad_batch) where the family trains unpacked."""
    return packed_tokens(st) if s.packed else st.micro_batch * (st.prompt_len + st.new_tokens)


# Bytes a logit of one chunk costs at the chunk's peak (train/logprobs.py _chunk_stats, forward and backward
# under its checkpoint): measured, one chunk against two (tests/test_step_memory_model.py), 20.0 on the CPU.
LOGIT_BYTES = 20


def update_working(s: MoEShape, st: StepSettings) -> dict[str, int]:
    """The update's working set with gradient checkpointing, by part; `total` is what it adds at its peak."""
    t = update_tokens(s, st)
    c = min(st.logprob_chunk, st.micro_batch * st.new_tokens)  # completion tokens in one logits chunk
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    pairs = t * s.top_k
    inter = s.expert_intermediate
    # each layer's input, kept for the recompute
    checkpoints = s.layers * t * s.hidden * BF16
    # the grouped experts' inputs (gate|up's: each pair's token; down's: the gated product) that the frozen
    # matmul's closure keeps from the forward until that layer's backward (StepSettings.expert_inputs_kept)
    kept = s.layers * pairs * (s.hidden + inter) * BF16 if st.expert_inputs_kept else 0
    # one chunk's logits, forward and backward (LOGIT_BYTES a logit)
    logits = c * s.vocab * LOGIT_BYTES
    # one decoder layer recomputed with its saved tensors and their gradients (x2): attention (norm input,
    # q|k|v, normed/rotated q and k, attention output, o input/output), the experts per (token, slot) pair
    # (gathered input, gate|up output, gated product, down output, weighted output), the router's fp32 logits
    # and probabilities; plus one chunk of dequantized experts (both projections), made again in the backward
    attn = t * (2 * s.hidden + 3 * q + 3 * kv) * BF16
    moe = pairs * (3 * s.hidden + 3 * inter) * BF16 + t * s.experts * 4 * 2
    dequantized = min(st.expert_chunk, s.experts) * sum(o * i for o, i in expert_shapes(s)) * BF16
    layer = 2 * (attn + moe) + dequantized
    # the logits' backward ends before the last layer's recompute starts: the larger of the two, on top of
    # what lives through the whole backward (the toy update measured against this: tests/)
    total = checkpoints + kept + max(logits, layer)
    return {"checkpoints": checkpoints, "expert_inputs_kept": kept, "logits": logits, "layer": layer,
            "dequantized_experts": dequantized, "total": total}


def rollout_working(s: MoEShape, st: StepSettings, slots: int) -> int:
    """The rollout's transients: a prefill chunk (each prompt once; projections over the prompts' tokens,
    the experts per pair of a chunk) with one chunk of dequantized experts, and the decode step's fp32
    logits, probabilities and sampler buffers over the slots."""
    t = min(st.prompts * st.prompt_len, st.prefill_chunk)
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    pairs = t * s.top_k
    act = t * (4 * s.hidden + q + 2 * kv) * BF16 + pairs * (3 * s.hidden + 3 * s.expert_intermediate) * BF16
    dequantized = min(st.expert_chunk, s.experts) * sum(o * i for o, i in expert_shapes(s)) * BF16
    return act + dequantized + 3 * slots * s.vocab * 4


@dataclass(frozen=True)
class Allowances:
    """What the terms leave out, read off one measured step (fit_allowances). residual: allocated bytes at
    the peak that no term accounts for, taken as one constant (not per layer: fitted alone on each full-depth
    record at ed5e22d it is 0.88 GiB on Qwen3-30B-A3B's 48 layers and 0.93 on gpt-oss-120b's 36); slack: the
    caching allocator's reserved over allocated at the peak. `fit_on` names the record. capped_slack: the slack
    of a run under a memory cap (StepSettings.memory_cap_gb), read off one capped record (`capped_fit_on`): capped,
    the allocator reserves much less over its peak (0.19 to 0.84 GiB at b8030c1 / 9b635f0 against 1.12 uncapped);
    None: capped runs get `slack` too."""
    residual: int
    slack: int
    fit_on: str = ""
    capped_slack: int | None = None
    capped_fit_on: str = ""

    def slack_for(self, st: "StepSettings") -> int:
        return self.slack if st.memory_cap_gb is None or self.capped_slack is None else self.capped_slack


NO_ALLOWANCES = Allowances(0, 0, "none")


def plan_step(s: MoEShape, st: StepSettings = StepSettings(), allow: Allowances | None = None) -> StepMemory:
    """The step's bytes by term; `allow`: the fitted allowances (default: DEFAULT_ALLOWANCES, from FIT_RECORD and
    CAPPED_FIT_RECORD)."""
    allow = DEFAULT_ALLOWANCES if allow is None else allow
    attn_fmt, exp_fmt = get_format("nvfp4"), get_format(s.expert_format)
    counts = parameter_counts(s)
    experts = s.layers * s.experts * sum(exp_fmt.nbytes(sh) for sh in expert_shapes(s))
    attention = s.layers * sum(attn_fmt.nbytes(sh) for sh in attention_shapes(s))
    dense = counts["dense"] * BF16
    if st.embed_4bit and not s.tied_embeddings:  # (a tied table is refused: quant_embed.quantize_embedding)
        dense += attn_fmt.nbytes((s.vocab, s.hidden)) - s.vocab * s.hidden * BF16
    copies = s.layers * sum(n * k * 9 // 16 for n, k in humming_copy_shapes(s)) if st.humming and not st.humming_storage else 0
    slots = kv_slots(s, st)
    kv = slots * kv_slot_bytes(s, st)
    return StepMemory(experts, attention, dense, copies, lora_bytes(s, st), kv, rollout_working(s, st, slots),
                      update_working(s, st)["total"], allow.residual, allow.slack_for(st), st.runtime_bytes, slots)


def fit_allowances(s: MoEShape, st: StepSettings, peak_allocated_gib: float, peak_reserved_gib: float,
                   fit_on: str = "") -> Allowances:
    """The allowances one measured step implies: its allocated peak over the terms, its reserved over allocated.
    Nothing but this one step's two figures enters them."""
    terms = plan_step(s, st, NO_ALLOWANCES).peak_allocated
    return Allowances(round(peak_allocated_gib * GIB) - terms, round((peak_reserved_gib - peak_allocated_gib) * GIB),
                      fit_on)


def with_capped_slack(allow: Allowances, peak_allocated_gib: float, peak_reserved_gib: float,
                      fit_on: str = "") -> Allowances:
    """`allow` with the capped slack one capped step implies: its reserved over allocated, nothing else (the residual
    stays the uncapped fit's: a cap moves no term)."""
    return replace(allow, capped_slack=round((peak_reserved_gib - peak_allocated_gib) * GIB), capped_fit_on=fit_on)


# The one measured step the default allowances are read from (benchmarks/results/step.jsonl; a test reads the
# figures back from there): `qerl bench step --shape qwen3-30b-a3b --prompts 8 --num-generations 8 --prompt-len
# 256 --max-new-tokens 256 --micro-batch 2 --steps 1 --optim adamw_torch --kv-cache-gb 3.4` on an H100, whose
# settings are StepSettings()'s. Every other measured step is out of sample (bench/memory_fit.py).
FIT_RECORD = {"case": "qwen3-30b-a3b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt kv3.4 adamw_torch", "commit": "ed5e22d",
              "peak_allocated": 24.537683963775635, "peak_reserved": 25.65625}
# The one capped step the capped slack is read from (a test reads it back too): the 24 GB recipe with fp8 KV 0.8 GiB
# (docs/moe-24gb.md) under `--memory-cap-gb 22` on an H200 (scripts/device.sh step_moe24). The other capped records
# are out of sample.
CAPPED_FIT_RECORD = {"case": "qwen3-30b-a3b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt chunk128 kv0.8 kv-fp8 adamw_8bit "
                             "cap22GiB no-humming", "commit": "b8030c1",
                     "peak_allocated": 18.681302547454834, "peak_reserved": 19.205078125}
DEFAULT_ALLOWANCES = with_capped_slack(
    fit_allowances(MOE_SHAPES["qwen3-30b-a3b"], StepSettings(expert_inputs_kept=True),  # ed5e22d
                   FIT_RECORD["peak_allocated"], FIT_RECORD["peak_reserved"],
                   f"{FIT_RECORD['case']}@{FIT_RECORD['commit']}"),
    CAPPED_FIT_RECORD["peak_allocated"], CAPPED_FIT_RECORD["peak_reserved"],
    f"{CAPPED_FIT_RECORD['case']}@{CAPPED_FIT_RECORD['commit']}")


def model_memory(s: MoEShape, layers: int | None = None, lora_rank: int = 32) -> int:
    """What `qerl bench step` reports as model_memory: the built policy's bytes (weights and bf16 LoRA factors)
    at `layers` decoder layers."""
    if layers is not None:
        from dataclasses import replace

        s = replace(s, layers=layers)
    p = plan_step(s, StepSettings(lora_rank=lora_rank))
    factors = s.layers * lora_rank * sum(o + i for o, i in attention_shapes(s)) * BF16
    return p.weights + factors


# What each shape should fit in (issue 39): the card its step targets, in GiB of that card's memory.
# issue 47 §5: 22 GiB reserved on a 24 GB card; issue 59: gpt-oss-20b in 14 GiB (Unsloth reports 15 GB)
TARGETS_GIB = {"qwen3-30b-a3b": 22, "gpt-oss-20b": 14, "gpt-oss-120b": 80}
# The measured step (benchmarks/results/step.jsonl, case@commit) of each target's model that stayed within it, whose
# settings are the recipe (docs/moe-24gb.md; tests/test_moe_memory.py reads them back from the record)
FITS_RECORDS = {
    "qwen3-30b-a3b": "qwen3-30b-a3b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt chunk128 kv0.8 kv-fp8 adamw_8bit cap22GiB "
                     "no-humming@b8030c1",
    "gpt-oss-20b": "gpt-oss-20b nvfp4 8x8 prompt256 new256 mu1 mb2 ckpt chunk128 kv0.5 kv-fp8 adamw_8bit cap14GiB "
                   "no-humming echunk128mib embed4bit@9b635f0",
    "gpt-oss-120b": "gpt-oss-120b nvfp4 8x8 prompt256 new128 mu1 mb2 ckpt kv2.6 adamw_torch@ed5e22d"}
