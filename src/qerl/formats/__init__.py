"""Weight formats: NVFP4 (the method's), MXFP4 and NF4 (the paper's comparisons), bf16."""

from .base import QuantizationError, WeightFormat
from .bf16 import BF16
from .mxfp4 import MXFP4
from .nf4 import NF4
from .nvfp4 import NVFP4

FORMATS = ("nvfp4", "mxfp4", "nf4", "bf16")


def get_format(name: str, **options) -> WeightFormat:
    """`nvfp4`, `mxfp4`, `nf4` (options: double_quant=True), `bf16`."""
    key = name.lower().replace("_", "-")
    if key == "nvfp4":
        return NVFP4()
    if key == "mxfp4":
        return MXFP4()
    if key in ("nf4", "nf4-dq"):
        return NF4(double_quant=options.get("double_quant", True))
    if key == "nf4-nodq":
        return NF4(double_quant=False)
    if key in ("bf16", "bfloat16", "none"):
        return BF16()
    raise ValueError(f"unknown weight format {name!r}; choose one of {', '.join(FORMATS)}")


__all__ = ["BF16", "FORMATS", "MXFP4", "NF4", "NVFP4", "QuantizationError", "WeightFormat", "get_format"]
