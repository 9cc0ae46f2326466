"""qerl export [MODEL] OUTPUT_DIR --adapter DIR: a merged dense model (dequantized base + LoRA). Without MODEL
the base is the one the adapter records (adapter_config.json's base_model_name_or_path); another MODEL is
refused unless --allow-other-base. The linears the run kept in bf16 (modules_to_not_convert, recorded beside
the adapter) are merged from their bf16 weights, as they were trained. SIGTERM ends it as Ctrl-C does: the
temporary removed, one line, status 143."""

from __future__ import annotations

HELP = "merge a LoRA adapter into the dequantized base and write a plain bf16 model folder"


def add_arguments(p):
    from .vocabulary import add_model_flag

    p.add_argument("model", nargs="?", default=None,
                   help="the base: a dense or compressed-tensors folder, hub id, or 'smollm2' (default: the base "
                        "the adapter records)")
    p.add_argument("output_dir")
    add_model_flag(p)
    p.add_argument("--adapter", help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--quant", default="auto", choices=["nvfp4", "mxfp4", "nf4", "bf16", "auto"],
                   help="base format the adapter was trained on (default: auto, the one the adapter recorded, else "
                        "the checkpoint's, else nvfp4); another than the adapter's is refused")
    p.add_argument("--allow-other-base", "--allow_other_base", dest="allow_other_base", action="store_true",
                   help="merge the adapter into a MODEL other than the base it records (it was trained on that one)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an OUTPUT_DIR that is not empty (never a run folder, the base or the adapter)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cpu")


def run(args):
    from ..checkpoint.atomic import Terminated, sigterm_unwinds
    from . import interrupted_line

    try:
        with sigterm_unwinds():  # from the first moment of run(): nothing is left half-written, and it says so
            return _run(args)
    except Terminated as e:
        import sys

        print(interrupted_line("export", e.signal_name), file=sys.stderr, flush=True)
        return e.code


def _run(args):
    from pathlib import Path

    import torch

    from ..checkpoint.export import check_export_target, export_merged
    from ..checkpoint.peft_adapter import read_adapter_config as _read_config, load_adapter, resolve_quant
    from ..checkpoint.peft_adapter import recorded_modules_to_not_convert
    from ..model import load_policy
    from ..model.resolve import ALIASES, resolve_model
    from ..model.smollm2 import cache_dir
    from .policy import check_device, read_model_config

    from .vocabulary import take_model_flag

    take_model_flag(args)
    if args.model is None:
        args.model = recorded_base(args.adapter)
    elif args.adapter:
        check_same_base(args.model, args.adapter, args.allow_other_base)
    # everything checked before the model loads: nothing in OUTPUT_DIR is lost by mistake
    base = args.model if Path(args.model).exists() else (
        cache_dir() / "SmolLM2-135M-Instruct" if args.model.lower() in ALIASES else None)
    check_export_target(args.output_dir, overwrite=args.overwrite, protected={"adapter": args.adapter, "base model": base})
    device = check_device(args.device)
    read_model_config(resolve_model(args.model))  # a config transformers cannot read: one line, no traceback
    if args.adapter:
        _read_config(Path(args.adapter))
    quant = resolve_quant(args.adapter, args.quant)
    # the layers the run kept in bf16 stay bf16: its LoRA corrects their bf16 weights, not a 4-bit rounding
    keep = recorded_modules_to_not_convert(args.adapter) if args.adapter else []
    # fp32 compute so the merge W + s·B·A is exact before the final cast
    policy = load_policy(args.model, quant, lora_rank=0, device=device, dtype=torch.float32,
                         modules_to_not_convert=keep or None)
    # the 4-bit head / embedding the policy trained with (qerl_adapter.json, else the run's config.yaml): the
    # export holds the values the policy computed with
    four_bit, record = run_4bit_options(args.adapter, policy.model) if args.adapter else ({}, None)
    if four_bit:
        quantize_as_trained(policy.model, **four_bit)
    if args.adapter:
        load_adapter(policy, args.adapter)
    out = export_merged(policy, args.output_dir, dtype=getattr(torch, args.dtype))
    print(f"wrote merged {args.dtype} model to {out}")
    if four_bit:
        what = [n for n in ("lm_head_4bit", "embed_4bit") if four_bit[n]]
        print(f"the trained {' and '.join(what)} (recorded in {record}): written as the dequantized 4-bit values "
              "the policy trained with")
    if keep:
        from ..model.projections import keep_in_bf16

        kept = [n for n, m in policy.model.named_modules()
                if keep_in_bf16(keep)(n) and getattr(getattr(m, "fmt", None), "name", "") == "bf16"]
        print(f"merged from their bf16 weights, as the run kept them (modules_to_not_convert {keep}, recorded in "
              f"{Path(args.adapter) / 'qerl_adapter.json'}): {len(kept)} layers, e.g. {kept[0] if kept else '-'}; "
              f"the rest from their {quant} rounding")


def run_4bit_options(adapter, model=None) -> tuple[dict, object]:
    """({lm_head_4bit, embed_4bit, dtype}, where they were read) of the policy an adapter was trained with;
    ({}, None) when neither option is on. First the adapter's own record (qerl_adapter.json, written by
    save_adapter: it travels with the folder), else the run's config.yaml (RUN/adapter or RUN/checkpoint-N/adapter;
    PEFT's files have no field for them; an older qerl_adapter.json neither). When both exist and disagree, one
    line says so and the adapter's win. dtype: the compute dtype the 4-bit copies were quantized from, which
    NVFP4's scales round in (fp32 weights give other bytes than the bf16 ones training quantized). model: the
    base as loaded for the export; a head it already holds in 4 bits (a packed compressed-tensors head) is kept
    whatever either says, so a disagreement on lm_head_4bit is not reported then."""
    from pathlib import Path

    from ..checkpoint.peft_adapter import INFO_NAME, recorded_4bit_options

    recorded = recorded_4bit_options(adapter)
    run_opts, explicit_dtype, cfg_path = _run_config_4bit_options(adapter)
    if recorded is None:  # nothing recorded beside the adapter: the run's config, as before these keys
        return (run_opts, cfg_path) if run_opts and (run_opts["lm_head_4bit"] or run_opts["embed_4bit"]) else ({}, None)
    info_path = Path(adapter) / INFO_NAME
    if recorded["dtype"] is None:  # a hand-edited record: the run's dtype if there is one
        if run_opts is None:
            on = ", ".join(k for k in ("lm_head_4bit", "embed_4bit") if recorded[k])
            raise ValueError(f"{info_path}: records {on} but no compute_dtype (the dtype its 4-bit copies were "
                             "quantized from, e.g. bfloat16): add it")
        recorded["dtype"] = run_opts["dtype"]
    if run_opts is None:
        return recorded, info_path
    from ..layers.quant_head import QuantHead

    moot = {"lm_head_4bit"} if isinstance(getattr(model, "lm_head", None), QuantHead) else set()
    differ = [f"{k} {recorded[k]} (there: {run_opts[k]})" for k in ("lm_head_4bit", "embed_4bit")
              if k not in moot and recorded[k] != run_opts[k]]
    if explicit_dtype and run_opts["dtype"] != recorded["dtype"]:  # "auto" resolves on this machine: not compared
        differ.append(f"dtype {str(recorded['dtype']).removeprefix('torch.')} "
                      f"(there: {str(run_opts['dtype']).removeprefix('torch.')})")
    if differ:
        print(f"qerl export: {info_path} disagrees with {cfg_path}: {'; '.join(differ)}; using the adapter's record")
        return recorded, info_path
    return recorded, f"{info_path} and {cfg_path}"


def _run_config_4bit_options(adapter) -> tuple[dict | None, bool, object]:
    """({lm_head_4bit, embed_4bit, dtype}, whether config.yaml names its dtype (not auto), the config.yaml) of
    the run an adapter folder sits in (RUN/adapter or RUN/checkpoint-N/adapter); (None, False, None) outside a
    run. The dtype of an "auto" config is resolved as training resolves it, on this machine."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    from ..train.fields import yaml_mapping
    from ..train.parts import resolve_device_dtype
    from .run_config import run_kind

    a = Path(adapter).resolve()
    for run in (a.parent, a.parent.parent) if a.name == "adapter" else ():
        if (run / "config.yaml").is_file() and run_kind(run) is not None:
            cfg = yaml_mapping(run / "config.yaml")
            opts = {k: cfg.get(k) is True for k in ("lm_head_4bit", "embed_4bit")}
            dt = SimpleNamespace(device=str(cfg.get("device", "auto")), dtype=str(cfg.get("dtype", "auto")))
            dtype = resolve_device_dtype(dt)[1] if dt.dtype == "auto" else getattr(torch, dt.dtype, None)
            return {**opts, "dtype": dtype}, dt.dtype != "auto", run / "config.yaml"
    return None, False, None


def quantize_as_trained(model, lm_head_4bit: bool, embed_4bit: bool, dtype) -> None:
    """Apply the run's lm_head_4bit / embed_4bit as load_configured_policy did, each quantized from its weights
    in the run's compute dtype. A head already 4-bit (read packed from a compressed-tensors base) is kept."""
    import torch
    from torch import nn

    from ..layers.quant_embed import QuantEmbedding, quantize_embedding
    from ..layers.quant_head import QuantHead, quantize_lm_head

    for on, module, quantize, done in ((lm_head_4bit, lambda: model.lm_head, quantize_lm_head, QuantHead),
                                       (embed_4bit, model.get_input_embeddings, quantize_embedding, QuantEmbedding)):
        m = module()
        if not on or isinstance(m, done):
            continue
        if m.weight.dtype != dtype:  # this module's own copy: a table tied to the head keeps the model's dtype
            m.weight = nn.Parameter(m.weight.detach().to(dtype), requires_grad=False)
        with torch.no_grad():
            quantize(model)


def check_same_base(model: str, adapter: str, allow_other: bool) -> None:
    """MODEL must be the base the adapter was trained on (its LoRA corrects that base's weights): the names it
    records (adapter_config.json's base_model_name_or_path, through adapter folders; qerl_adapter.json's
    base_local) against MODEL, spelt as PEFT records it (the offline alias as its hub id, a folder absolute)."""
    from pathlib import Path

    from ..checkpoint.peft_adapter import peft_base_name, recorded_base_local
    from ..model.adapter_start import base_of

    named = base_of(adapter)
    if named == str(adapter):  # records no base: nothing to hold MODEL to
        return
    recorded = {peft_base_name(named)}
    local = recorded_base_local(adapter)
    if local is not None:
        recorded.add(str(local.resolve()))
    given = Path(model).expanduser()
    mine = {peft_base_name(model)} | ({str(given.resolve())} if given.is_dir() else set())
    if mine & recorded:
        return
    where = Path(adapter) / "adapter_config.json"
    if allow_other:
        print(f"qerl export: merging the adapter trained on {named} into {model} (--allow-other-base)")
        return
    raise ValueError(f"{model}: not the base the adapter was trained on ({where}: base_model_name_or_path {named}"
                     f"{f', loaded from {local}' if local else ''}); its LoRA corrects that base's weights: give that "
                     "base (or leave MODEL out), or pass --allow-other-base to merge into this one anyway")


def recorded_base(adapter: str | None) -> str:
    """The base an adapter folder records (PEFT's base_model_name_or_path), as the model to merge into."""
    import json
    from pathlib import Path

    if not adapter:
        raise ValueError("give the base MODEL, or --adapter DIR whose adapter_config.json records it")
    path = Path(adapter) / "adapter_config.json"
    try:
        base = json.loads(path.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the base the adapter records ({e}); give the base MODEL") from None
    if not base:
        raise ValueError(f"{path} records no base_model_name_or_path; give the base MODEL")
    return base
