"""gpt-oss (20b, 120b): attention with biases and a learned sink logit per head, sliding and full layers
alternating (config.layer_types), yarn rotary given for one half of each head, norms computing
(w * x_hat).to(dtype), every MLP a routed MoE (router with a bias; top-k logits, then a softmax over
them) whose experts have biases and the clamped gating (u + 1)·g·σ(1.702 g) on interleaved gate/up
columns. The stock checkpoint holds the experts fused and transposed ([E, K, N]), in MXFP4
(`*_blocks`, `*_scales`) or dense; MXFP4 is repacked as qerl's mxfp4 tensors, never re-quantized.
LoRA on attention."""

from ..family import Experts, attention_only_moe

FAMILY = attention_only_moe("gpt_oss", ("gpt_oss",), "GptOssForCausalLM", "GptOssDecoderLayer",
                            Experts(count="num_local_experts", intermediate="intermediate_size", per_expert=False,
                                    bias=True, checkpoint_format="mxfp4"),
                            norm_form="fp32", rope_halves=True, sinks=True,
                            tested_against="HF generate on a tiny random GptOssForCausalLM from a stock MXFP4 "
                                           "checkpoint (transformers' dequantization; sinks, window 8), byte-exact "
                                           "MXFP4 round trip")
