"""Which architectures we support and how their projections are named and fused.

The families and what differs between them are described in model/family.py (one file each in
model/families/); the names below are Llama's, the default of the shape-only random models.
"""

from __future__ import annotations

from .family import Family, family_of_config, supported_architectures

SUPPORTED_ARCHITECTURES = supported_architectures()

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


def check_architecture(config, source: str) -> Family:
    """The config's family, checked on model_type and its label (family.family_of_config)."""
    return family_of_config(config, source)
