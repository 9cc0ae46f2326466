"""Projected GPU memory of one GRPO step for MoE shapes (Qwen3-30B-A3B, gpt-oss-20b/120b): computed,
not measured.

What a step holds at its peak: the frozen weights (attention NVFP4, experts NVFP4 or gpt-oss's own
MXFP4, embeddings / lm_head / routers / norms in bf16), the LoRA factors with their gradients and
optimizer state, the rollout's KV cache (allocated once, kept through the update), and the larger of
the rollout's and the update's working memory (the update with gradient checkpointing: each layer's
input kept, one layer recomputed at a time, the logits chunked). Quantized bytes come from the
formats' own tensor shapes (`WeightFormat.nbytes`), so they are what the loader allocates; the
working sets are upper-bound estimates. The figures are projections; `qerl bench step --shape
qwen3-30b-a3b` (or gpt-oss-20b / 120b) builds the shape with random weights on a GPU and measures a step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

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
                   fam.qk_norm == "head", fam.sinks)


def _moe_shapes() -> dict[str, MoEShape]:
    """The real MoE shapes, from the configs the random builder makes (model/random_init.py's MOE)."""
    from ..model.random_init import moe_config

    return {n: MoEShape.of(n, moe_config(n)) for n in ("qwen3-30b-a3b", "gpt-oss-20b", "gpt-oss-120b")}


MOE_SHAPES = _moe_shapes()


@dataclass(frozen=True)
class StepSettings:
    rows: int = 64                # prompts x generations in one step (8 x 8, as qerl bench step)
    prompt_len: int = 256
    new_tokens: int = 2048
    kv_rows: int = 16             # sequences the KV cache holds at once (continuous batching admits the rest)
    kv_bytes: int = 1             # per cached value: 1 (fp8) or 2 (bf16)
    micro_batch: int = 2          # completions per forward/backward
    logprob_chunk: int = 1024     # tokens whose logits exist at once in the update
    lora_rank: int = 32           # on attention (q, k, v, o); LoRA on experts is not in the trainer yet
    lora_bytes_per_param: int = 16  # fp32 factor, fp32 gradient, two fp32 AdamW moments (the worst case)
    prefill_chunk: int = 2048     # the engine's prefill chunk (tokens)
    expert_chunk: int = 16        # experts dequantized at once by the grouped path (QuantExperts.expert_chunk),
                                  # made again in the backward rather than saved (layers/grouped_mm.py)
    runtime_bytes: int = GIB      # CUDA context, cuBLAS workspaces, allocator slack (outside torch's count)


@dataclass(frozen=True)
class StepMemory:
    """Bytes by what holds them; `peak` adds the larger of the two phases' working sets."""
    experts: int
    attention: int
    dense: int                    # embeddings, lm_head, routers, norms, sinks, biases
    lora_and_optimizer: int
    kv_cache: int
    rollout_working: int
    update_working: int
    runtime: int

    @property
    def weights(self) -> int:
        return self.experts + self.attention + self.dense

    @property
    def peak(self) -> int:
        return (self.weights + self.lora_and_optimizer + self.kv_cache + self.runtime
                + max(self.rollout_working, self.update_working))

    def gib(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) / GIB for f in fields(self)}
        out.update(weights=self.weights / GIB, peak=self.peak / GIB)
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


def plan_step(s: MoEShape, st: StepSettings = StepSettings()) -> StepMemory:
    attn_fmt, exp_fmt = get_format("nvfp4"), get_format(s.expert_format)
    counts = parameter_counts(s)
    experts = s.layers * s.experts * sum(exp_fmt.nbytes(sh) for sh in expert_shapes(s))
    attention = s.layers * sum(attn_fmt.nbytes(sh) for sh in attention_shapes(s))
    dense = counts["dense"] * BF16
    lora = s.layers * st.lora_rank * sum(o + i for o, i in attention_shapes(s)) * st.lora_bytes_per_param
    seq = st.prompt_len + st.new_tokens
    kv_per_token = 2 * s.layers * s.kv_heads * s.head_dim * st.kv_bytes
    kv = st.kv_rows * seq * kv_per_token
    q_kv = s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim
    moe_act = s.top_k * 3 * s.expert_intermediate            # gate|up out and the gated product, per token
    one_expert = sum(o * i for o, i in expert_shapes(s)) * BF16
    dequantized = min(st.expert_chunk, s.experts) * one_expert  # the grouped path's chunk (decode: none, GEMV)
    rollout = (st.prefill_chunk * (4 * s.hidden + q_kv + moe_act + s.experts) * BF16 + dequantized
               + st.kv_rows * s.vocab * 4)
    tokens = st.micro_batch * seq
    checkpoints = s.layers * tokens * s.hidden * BF16
    # one layer recomputed with its gradients (x3: values, their gradients, autograd's saved copies)
    layer = 3 * tokens * (4 * s.hidden + q_kv + moe_act + 2 * s.experts) * BF16 + dequantized
    logits = 2 * st.logprob_chunk * s.vocab * 4             # fp32 logits of a chunk and their gradient
    update = checkpoints + layer + logits + 2 * tokens * s.hidden * BF16
    return StepMemory(experts, attention, dense, lora, kv, rollout, update, st.runtime_bytes)


# What each shape should fit in (issue 39): the card its step targets, in GiB of that card's memory.
TARGETS_GIB = {"qwen3-30b-a3b": 24, "gpt-oss-120b": 80}
