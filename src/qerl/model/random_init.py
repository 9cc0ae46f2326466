"""A policy with random weights from a config alone: benchmarks at 7B-72B shapes, no download.

Built like `load_policy` (meta skeleton, one decoder layer at a time quantized on
the device), so its memory is that of the real model in the same format.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..formats import get_format
from .architectures import DEFAULT_TARGETS, FUSED_GROUPS, TARGET_MODULES, normalize_targets
from .load import Policy, _build_skeleton, _materialize_buffers, _set_tensor, build_projections, install_group

# Shapes of the models the benchmarks use (hidden, intermediate, layers, heads, kv heads, vocab).
QWEN25 = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, 152064),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064),
    "qwen2.5-72b": (8192, 29568, 80, 64, 8, 152064),
    "tiny": (64, 128, 2, 4, 2, 1024),  # Qwen2 layout at toy size: CPU tests of the benchmarks
}


def qwen25_config(name: str, num_hidden_layers: int | None = None):
    from transformers import Qwen2Config

    h, i, n, heads, kv, vocab = QWEN25[name]
    return Qwen2Config(architectures=["Qwen2ForCausalLM"], hidden_size=h, intermediate_size=i,
                       num_hidden_layers=num_hidden_layers or n, num_attention_heads=heads, num_key_value_heads=kv,
                       vocab_size=vocab, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=name == "qwen2.5-0.5b", eos_token_id=151645 if vocab > 151645 else 1)


def random_policy(config, quant: str = "nvfp4", *, lora_rank: int = 32, lora_alpha: float | None = None,
                  target_modules=DEFAULT_TARGETS, device="cuda", dtype=torch.bfloat16, seed: int = 0,
                  std: float = 0.02, progress: bool = True, fuse_groups: bool = True) -> Policy:
    fmt = get_format(quant)
    targets = normalize_targets(target_modules)
    alpha = float(lora_alpha if lora_alpha is not None else 2 * lora_rank)
    device = torch.device(device)
    model, cfg = _build_skeleton(config, dtype, False)
    g = torch.Generator(device=device).manual_seed(seed)
    lora = dict(r=lora_rank, lora_alpha=alpha, dtype=dtype) if lora_rank else dict(dtype=dtype)
    groups = list(FUSED_GROUPS) + [(t,) for t in TARGET_MODULES if not any(t in x for x in FUSED_GROUPS)]
    for i in tqdm(range(cfg.num_hidden_layers), desc=f"random {quant} model", disable=not progress, unit="layer"):
        for group in groups:
            names = [f"model.layers.{i}.{TARGET_MODULES[t]}" for t in group if t in targets]
            if not names:
                continue
            mods = [model.get_submodule(n) for n in names]
            ws = [torch.randn(m.weight.shape, device=device, generator=g, dtype=torch.float32).mul_(std).to(dtype)
                  for m in mods]
            gs = fmt.global_scale(ws) if fmt.has_global_scale else None
            biases = [None if m.bias is None else
                      torch.randn(m.bias.shape, device=device, generator=g).mul_(std).to(dtype) for m in mods]
            for n, w in zip(names, ws):
                fmt.validate(w, n)
            fuse = fuse_groups and len(group) > 1 and len(names) == len(group)
            layers, qgroup = build_projections(names, [tuple(w.shape) for w in ws], biases, fmt, lora, device,
                                               lambda j: fmt.quantize(ws[j], gs), fuse)
            for n, layer in zip(names, layers):
                parent, _, attr = n.rpartition(".")
                setattr(model.get_submodule(parent), attr, layer)
            if qgroup is not None:
                install_group(model, names, qgroup)
            del ws
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, t in list(model.state_dict(keep_vars=True).items()):
        if not t.is_meta or ".lora_" in name or (tied and name == "lm_head.weight"):
            continue
        if name.endswith("norm.weight"):
            v = torch.ones(t.shape, device=device, dtype=dtype)
        else:
            v = torch.randn(t.shape, device=device, generator=g, dtype=torch.float32).mul_(std).to(dtype)
        _set_tensor(model, name, v, "random init")
    if tied:
        model.tie_weights()
    _materialize_buffers(model, cfg, device)
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    model.eval()
    return Policy(model, None, "random", quant, lora_rank, alpha, 0.0, targets, [])
