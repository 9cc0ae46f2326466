"""Which architectures we support, and the LoRA target names users pass by default.

The families and what differs between them are described in model/family.py (one file each in
model/families/); the names below are Llama's, the default of the shape-only random models.
"""

from __future__ import annotations

import os

from .family import LLAMA_PROJECTIONS, Family, family_of_config, supported_architectures

SUPPORTED_ARCHITECTURES = supported_architectures()

# Short names users pass (as in the paper: q,k,v,o,gate,up,down) -> module suffix: Llama's, the default
# targets; each family maps them to its own projections (Family.normalize_targets).
TARGET_MODULES = LLAMA_PROJECTIONS
DEFAULT_TARGETS = tuple(TARGET_MODULES)


# the config fields naming how many experts route each token, as the families spell it
TOP_K_FIELDS = ("num_experts_per_tok", "experts_per_token")


def check_architecture(config, source: str) -> Family:
    """The config's family, checked on model_type and its label (family.family_of_config), and its
    fields that transformers takes without a word but fail in the first forward."""
    family = family_of_config(config, source)
    if family.experts is not None:
        check_routing(config, family.experts.count, source)
    return family


def check_routing(config, count_field: str, source: str) -> None:
    """An MoE's experts per token within its experts: top-k of 9 among 8 failed only in the first forward
    ("selected index k out of range")."""
    n = getattr(config, count_field, None)
    for name in TOP_K_FIELDS:
        k = getattr(config, name, None)
        if isinstance(k, int) and isinstance(n, int) and not 1 <= k <= n:
            where = f"{source}/config.json" if os.path.isdir(source) else source
            raise ValueError(f"{where}: {name} is {k}, but the model has {n} experts ({count_field}); "
                             f"it must be between 1 and {n}")
