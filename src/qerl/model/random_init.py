"""A policy with random weights from a config alone: benchmarks at 7B-120B shapes, no download.

Built like `load_policy` (meta skeleton, one decoder layer at a time quantized on the device, the
model's family deciding the projections, their fused groups and the MoE experts), so its memory is
that of the real model in the same format. An MoE layer's experts become a `QuantExperts`, generated
and quantized a chunk of experts at a time on the device: a layer of gpt-oss-120b's experts is 6 GB in
bf16, the whole model's ~61 GB quantized on an 80 GB card.
"""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..formats import get_format
from .architectures import DEFAULT_TARGETS, check_architecture
from .family import family_of_model
from .load import Policy, build_skeleton, install_module, materialize_buffers, set_tensor
from .projections import build_projections, install_group

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


def _qwen3_moe(layers, **kw):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=layers, norm_topk_prob=True,
                          rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, **kw)


def _gpt_oss(layers, **kw):
    from transformers import GptOssConfig

    # transformers' defaults are gpt-oss-20b/120b's (hidden 2880, 64 heads of 64, 8 kv heads, vocab
    # 201088, top-4, yarn rotary, sliding window 128 on every other layer); layer_types follow the count
    return GptOssConfig(architectures=["GptOssForCausalLM"], num_hidden_layers=layers, **kw)


# MoE shapes (bench/step_plan.py's MOE_SHAPES are read from these): name -> (layers, config of n layers)
MOE = {
    "qwen3-30b-a3b": (48, lambda n: _qwen3_moe(
        n, vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        max_position_embeddings=40960, eos_token_id=151645)),
    "gpt-oss-20b": (24, lambda n: _gpt_oss(n, num_local_experts=32, eos_token_id=200002, pad_token_id=199999)),
    "gpt-oss-120b": (36, lambda n: _gpt_oss(n, num_local_experts=128, eos_token_id=200002, pad_token_id=199999)),
    # toy sizes: CPU tests of the benchmarks on a real MoE step
    "qwen3-moe-tiny": (2, lambda n: _qwen3_moe(
        n, vocab_size=1024, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, max_position_embeddings=512,
        eos_token_id=1)),
    "gpt-oss-tiny": (2, lambda n: _gpt_oss(
        n, vocab_size=1024, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16, "rope_theta": 150000.0},
        eos_token_id=1, pad_token_id=0)),
}

EXPERT_CHUNK = 16  # experts generated (bf16) and quantized at once: 0.8 GB at gpt-oss's 2880 x 5760 + 2880 x 2880


def moe_config(name: str, num_hidden_layers: int | None = None):
    """The transformers config of an MoE shape (MOE), optionally with fewer decoder layers."""
    if name not in MOE:
        raise ValueError(f"unknown MoE shape {name!r}; choose from {', '.join(MOE)}")
    layers, make = MOE[name]
    return make(num_hidden_layers or layers)


def shape_config(name: str, num_hidden_layers: int | None = None):
    """The config of any benchmark shape: dense Qwen2.5 (QWEN25) or MoE (MOE)."""
    if name in MOE:
        return moe_config(name, num_hidden_layers)
    if name in QWEN25:
        return qwen25_config(name, num_hidden_layers)
    raise ValueError(f"unknown shape {name!r}; choose from {', '.join([*QWEN25, *MOE])}")


def random_policy(config, quant: str = "nvfp4", *, lora_rank: int = 32, lora_alpha: float | None = None,
                  target_modules=DEFAULT_TARGETS, device="cuda", dtype=torch.bfloat16, seed: int = 0,
                  std: float = 0.02, progress: bool = True, fuse_groups: bool = True,
                  experts_quant: str | None = None, expert_chunk: int = EXPERT_CHUNK) -> Policy:
    """Random weights (normal, `std`; norms ones) in `config`'s shape, built as load_policy builds a model of
    its family: targeted projections quantized + LoRA, an MoE's experts a QuantExperts in `experts_quant`
    (default: the family's checkpoint format, Experts.checkpoint_format, else `quant`), routers, sinks,
    norms and embeddings in `dtype`. LoRA on the experts only if the targets name "experts"."""
    source = f"random:{'/'.join(getattr(config, 'architectures', None) or [config.model_type])}"
    family = check_architecture(config, source)
    fmt = get_format(quant)
    targets = family.normalize_targets(target_modules)
    experts_lora = lora_rank if family.lora_on_experts(target_modules) else 0
    alpha = float(lora_alpha if lora_alpha is not None else 2 * lora_rank)
    device = torch.device(device)
    model, cfg = build_skeleton(config, dtype, False)
    family_of_model(model, source)
    g = torch.Generator(device=device).manual_seed(seed)
    lora = dict(r=lora_rank, lora_alpha=alpha, dtype=dtype) if lora_rank else dict(dtype=dtype)
    fused = family.fused_groups
    groups = list(fused) + [(t,) for t in family.projections if not any(t in x for x in fused)]
    exp_fmt = None
    if family.experts is not None:
        exp_fmt = get_format(experts_quant or family.experts.checkpoint_format or quant)
    for i in tqdm(range(cfg.num_hidden_layers), desc=f"random {quant} model", disable=not progress, unit="layer"):
        for group in groups:
            names = [family.module(i, t) for t in group if t in targets]
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
        if family.experts is not None:
            module = f"model.layers.{i}.{family.experts.path}"
            q = random_experts(model.get_submodule(module), exp_fmt, device, g, std, module, expert_chunk)
            install_module(model, module, q)
            if experts_lora:
                q.add_lora(experts_lora, alpha, dtype)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    for name, t in list(model.state_dict(keep_vars=True).items()):
        if not t.is_meta or ".lora_" in name or (tied and name == "lm_head.weight"):
            continue
        if name.endswith("norm.weight"):
            v = torch.ones(t.shape, device=device, dtype=dtype)
        else:
            v = torch.randn(t.shape, device=device, generator=g, dtype=torch.float32).mul_(std).to(dtype)
        set_tensor(model, name, v, "random init")
    if tied:
        model.tie_weights()
    materialize_buffers(model, cfg, device)
    if torch.device(device).type == "cuda":
        from ..kernels import plan_copies

        plan_copies(model)  # as load_policy: whether humming's weight copies fit, decided at load
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_A." in n or ".lora_B." in n)
    model.eval()
    return Policy(model, None, "random", quant, lora_rank, alpha, 0.0,
                  targets + (("experts",) if experts_lora else ()), [])


def random_experts(skeleton, fmt, device, g: torch.Generator, std: float = 0.02, name: str = "experts",
                   chunk: int = EXPERT_CHUNK):
    """A QuantExperts in the shape of transformers' (meta) experts module `skeleton`: random weights
    [E, N, K] (QuantExperts' layout whatever HF's; gpt-oss's transposed [E, K, N] only flags it), biases
    where the module has them, its gating. Generated in the module's dtype and quantized `chunk` experts
    at a time, each chunk's tensors copied into the layer's [E, ...] storage: at most one chunk of dense
    experts exists at once, beside the layer's quantized bytes."""
    from ..layers.quant_experts import PROJECTIONS, QuantExperts

    fmt = get_format(fmt) if isinstance(fmt, str) else fmt
    dtype = skeleton.gate_up_proj.dtype
    transposed = bool(getattr(skeleton, "is_transposed", False))
    n = skeleton.gate_up_proj.shape[0]
    shapes = {p: tuple(getattr(skeleton, p).shape[1:]) for p in PROJECTIONS}  # HF's [N, K] ([K, N] transposed)
    if transposed:
        shapes = {p: s[::-1] for p, s in shapes.items()}

    def randn(shape):
        return torch.randn(shape, device=device, generator=g, dtype=dtype).mul_(std)

    biases = {p: randn((n, shapes[p][0])) for p in PROJECTIONS} if getattr(skeleton, "has_bias", False) else None
    tensors: dict[str, dict[str, torch.Tensor]] = {p: {} for p in PROJECTIONS}
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        ws = [randn((hi - lo, *shapes[p])) for p in PROJECTIONS]
        part = QuantExperts.quantize(*ws, fmt, skeleton._apply_gate, dtype, name)
        del ws
        for p in PROJECTIONS:
            for k, t in part.stacked(p).items():
                if k not in tensors[p]:
                    tensors[p][k] = torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device)
                tensors[p][k][lo:hi].copy_(t)
        del part
    return QuantExperts(tensors, shapes, fmt, skeleton._apply_gate, dtype, name, biases, transposed)
