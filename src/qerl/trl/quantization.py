"""TRL's quantization_config (transformers' BitsAndBytesConfig) as qerl's base format: qerl always trains
on a 4-bit base of its own formats, so bitsandbytes' 4-bit NF4 is qerl's nf4 and its 4-bit FP4 qerl's
nvfp4 (said in one line); an 8-bit or other quantization is refused by name with the nearest choice."""

from __future__ import annotations

from ..train.trl_fields import refuse

NEAREST = "quantization_config=None and the config's quant (nvfp4 | mxfp4 | nf4): qerl's base is always 4-bit"


def quant_of(quantization_config) -> str | None:
    """The config's `quant` for a quantization_config (None: keep the config's)."""
    if quantization_config is None:
        return None
    q = quantization_config
    if getattr(q, "load_in_4bit", False):
        kind = getattr(q, "bnb_4bit_quant_type", "fp4")
        if kind == "nf4":
            return "nf4"
        print("qerl: quantization_config: bitsandbytes' 4-bit fp4 base is trained on qerl's nvfp4 (FP4 values in "
              "blocks of 16 with FP8 scales)", flush=True)
        return "nvfp4"
    raise refuse("quantization_config", type(q).__name__ + ("(load_in_8bit=True)" if getattr(q, "load_in_8bit", False)
                                                               else ""), NEAREST)
