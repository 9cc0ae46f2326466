"""Which architectures we support, and the LoRA target names users pass by default.

The families and what differs between them are described in model/family.py (one file each in
model/families/); the names below are Llama's, the default of the shape-only random models.
"""

from __future__ import annotations

from .family import LLAMA_PROJECTIONS, Family, family_of_config, supported_architectures

SUPPORTED_ARCHITECTURES = supported_architectures()

# Short names users pass (as in the paper: q,k,v,o,gate,up,down) -> module suffix: Llama's, the default
# targets; each family maps them to its own projections (Family.normalize_targets).
TARGET_MODULES = LLAMA_PROJECTIONS
DEFAULT_TARGETS = tuple(TARGET_MODULES)


def check_architecture(config, source: str) -> Family:
    """The config's family, checked on model_type and its label (family.family_of_config)."""
    return family_of_config(config, source)
