"""Which format a checkpoint folder holds, decided by its tensors (config.json's label only names it):
dense float weights, compressed-tensors NVFP4/MXFP4, gpt-oss's own MXFP4 experts, or a quantized format
qerl does not read, refused by name."""

from __future__ import annotations

import logging

from .safetensors_reader import SafetensorsCheckpoint

log = logging.getLogger(__name__)

CT_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4"}
READS = ("qerl reads dense float weights (bf16/fp16/fp32 safetensors) and compressed-tensors "
         f"{'/'.join(CT_FORMATS)} checkpoints")
DENSE_DTYPES = ("BF16", "F16", "F32", "F64")
# tensor-name markers of quantized formats qerl does not read (checked on the tensors, not the label)
FOREIGN_MARKERS = (
    ((".absmax", ".quant_map", ".quant_state."), "bitsandbytes 4-bit (NF4/FP4: absmax/quant_state tensors)"),
    ((".SCB",), "bitsandbytes 8-bit (LLM.int8: SCB tensors)"),
    ((".weight_scale_inv",), "FP8 with block scales (weight_scale_inv tensors)"),
    ((".W_q",), "HQQ (W_q tensors)"),
)


def checkpoint_format(config, source, ckpt: SafetensorsCheckpoint) -> tuple[str | None, list[str]]:
    """(format or None for a dense checkpoint, ignore list), decided by the tensors themselves.

    config.json's quantization_config is only a label, and a stale one is common (a folder written by
    save_pretrained after loading a GGUF keeps quant_method "gguf" over dense bf16 weights): dense
    float projection weights load as dense whatever it says, with a note. Packed tensors must carry a
    compressed-tensors NVFP4/MXFP4 label; quantized tensors of any other format are refused by name."""
    label = quant_label(config)
    method = label.get("quant_method")
    foreign = _foreign_format(ckpt, method)
    if foreign:
        raise ValueError(f"{source}: the weights are quantized as {foreign}; {READS}. Load the original "
                         "dense model, or dequantize it (e.g. transformers' from_pretrained, then save_pretrained)")
    if any(k.endswith(".weight_packed") for k in ckpt.keys()):
        return compressed_format(label, source)
    if method == "mxfp4" and any(k.endswith("_proj_blocks") for k in ckpt.keys()):
        return None, []  # gpt-oss's own MXFP4 experts (read packed by checkpoint/moe_experts.py); the rest is dense
    if label:
        log.warning("%s/config.json: quantization_config (quant_method %r) does not match the tensors, which "
                    "are dense %s; loading them as a dense checkpoint and ignoring the label",
                    source, method, "/".join(sorted(_projection_dtypes(ckpt))))
    return None, []


def quant_label(config) -> dict:
    q = getattr(config, "quantization_config", None)
    if q is None:
        return {}
    return dict(q) if isinstance(q, dict) else q.to_dict()


def _projection_dtypes(ckpt) -> set[str]:
    return {ckpt.dtype(k) for k in ckpt.keys() if k.endswith("_proj.weight")}


def _foreign_format(ckpt, method) -> str | None:
    """The name of the quantized format the tensors are in, when qerl cannot read it; else None."""
    keys = list(ckpt.keys())
    if any(k.endswith(".qweight") for k in keys):  # GPTQ and AWQ share qweight/qzeros/scales
        gptq = method == "gptq" or (method != "awq" and any(k.endswith(".g_idx") for k in keys))
        return ("GPTQ" if gptq else "AWQ") + " (qweight/qzeros/scales tensors)"
    for markers, name in FOREIGN_MARKERS:
        if any(k.endswith(m) or (m.endswith(".") and m in k) for k in keys for m in markers):
            return name
    packed = any(k.endswith(".weight_packed") for k in keys)
    odd = sorted(_projection_dtypes(ckpt) - set(DENSE_DTYPES))
    if odd and not packed:
        what = f"quant_method {method!r}" if method else "a format config.json does not name"
        return f"{what} (projection weights stored as {'/'.join(odd)})"
    return None


def compressed_format(q: dict, source) -> tuple[str, list[str]]:
    """Packed tensors: the format named by the compressed-tensors label, which must be one qerl reads."""
    if q.get("quant_method") != "compressed-tensors":
        raise ValueError(f"{source}: the safetensors hold packed (weight_packed) tensors but config.json's "
                         f"quantization_config.quant_method is {q.get('quant_method')!r}, not "
                         f"'compressed-tensors'; {READS}")
    groups = q.get("config_groups") or {}
    fmts = {g.get("format") or q.get("format") for g in groups.values()} or {q.get("format")}
    if len(fmts) != 1 or next(iter(fmts)) not in CT_FORMATS:
        raise ValueError(f"{source}/config.json: quantization format {sorted(map(str, fmts))} is not supported; "
                         f"{READS}")
    if q.get("quantization_status") not in (None, "compressed"):
        raise ValueError(f"{source}/config.json: quantization_status {q.get('quantization_status')!r}; expected 'compressed'")
    return CT_FORMATS[next(iter(fmts))], list(q.get("ignore") or [])
