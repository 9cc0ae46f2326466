"""Which architectures we support and how their projections are named and fused."""

from __future__ import annotations

# Decoder layers of these share Llama's module names (self_attn.{q,k,v,o}_proj,
# mlp.{gate,up,down}_proj, input/post_attention_layernorm, model.rotary_emb).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")

# Short names users pass (as in the paper: q,k,v,o,gate,up,down) -> module suffix.
TARGET_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
DEFAULT_TARGETS = tuple(TARGET_MODULES)

# Projections that vLLM fuses into one matmul; NVFP4 gives each group one global scale.
FUSED_GROUPS = (("q", "k", "v"), ("gate", "up"))


def normalize_targets(targets) -> tuple[str, ...]:
    """Accept short names ('q') or module names ('q_proj', 'self_attn.q_proj')."""
    out = []
    for t in targets:
        key = t.split(".")[-1].removesuffix("_proj")
        if key not in TARGET_MODULES:
            raise ValueError(f"unknown target module {t!r}; choose from {', '.join(TARGET_MODULES)}")
        out.append(key)
    return tuple(dict.fromkeys(out))


def check_architecture(config, source: str) -> None:
    archs = list(getattr(config, "architectures", None) or [])
    if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(
            f"{source}: unsupported architecture {archs or config.model_type!r}; "
            f"qerl supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
