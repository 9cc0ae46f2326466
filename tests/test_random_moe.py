"""Random-weight MoE policies (model/random_init.py) in the real shapes of Qwen3-30B-A3B and gpt-oss-20b/120b
and at toy size: built as load_policy builds the family (experts a QuantExperts in nvfp4, gpt-oss's in
its checkpoint's mxfp4; attention quantized with LoRA; routers, sinks, norms in the model dtype), their
bytes those the step planner projects, and one GRPO step of `qerl bench step` on the CPU."""


import pytest
import torch
from transformers import AutoModelForCausalLM

from qerl.bench import step as bstep
from qerl.bench.step_plan import MOE_SHAPES, MoEShape, StepSettings, parameter_counts, plan_step
from qerl.layers import QLoRALinear
from qerl.layers.quant_experts import PROJECTIONS, QuantExperts
from qerl.model import moe_config, random_policy
from qerl.model.random_init import random_experts
from test_moe_memory import REAL, _counts

TINY = {"qwen3-moe-tiny": "nvfp4", "gpt-oss-tiny": "mxfp4"}  # shape -> its experts' format (quant nvfp4)
TINY_FORMATS = {"qwen3_moe": "nvfp4", "gpt_oss": "mxfp4"}  # the checkpoints' own: gpt-oss ships MXFP4 experts


def _shape(name) -> MoEShape:
    """The step planner's description of a config (one of MOE) with quant nvfp4."""
    c = moe_config(name)
    gpt = c.model_type == "gpt_oss"
    return MoEShape(name, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                    c.head_dim, c.vocab_size, c.num_local_experts if gpt else c.num_experts, c.num_experts_per_tok,
                    c.intermediate_size if gpt else c.moe_intermediate_size,
                    TINY_FORMATS[c.model_type], gpt, gpt, bool(c.tie_word_embeddings), qk_norm=not gpt, sinks=gpt)


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request):
    name = request.param
    pol = random_policy(moe_config(name), "nvfp4", lora_rank=4, device="cpu", dtype=torch.bfloat16, progress=False)
    return name, pol


def test_experts_are_quantized_attention_has_lora_and_the_rest_stays(tiny):
    name, pol = tiny
    cfg = pol.config
    gpt = cfg.model_type == "gpt_oss"
    assert pol.target_modules == ("q", "k", "v", "o") and pol.quant == "nvfp4"
    for i, layer in enumerate(pol.model.model.layers):
        ex = layer.mlp.experts
        assert isinstance(ex, QuantExperts) and ex.fmt.name == TINY[name] and ex.r == 0
        assert ex.num_experts == (cfg.num_local_experts if gpt else cfg.num_experts)
        assert ex.transposed == gpt and ex.has_bias == gpt
        inter = cfg.intermediate_size if gpt else cfg.moe_intermediate_size
        assert ex.shapes == {"gate_up_proj": (2 * inter, cfg.hidden_size), "down_proj": (cfg.hidden_size, inter)}
        for proj in PROJECTIONS:  # every expert got its own random weights (no chunk left empty or repeated)
            ws = [ex.weight(proj, e, torch.float32) for e in range(ex.num_experts)]
            assert all(w.abs().sum() > 0 for w in ws)
            assert all(not torch.equal(ws[0], w) for w in ws[1:])
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(layer.self_attn, p)
            assert isinstance(lin, QLoRALinear) and lin.fmt.name == "nvfp4" and lin.r == 4
            assert (lin.bias is not None) == gpt
        router = layer.mlp.router if gpt else layer.mlp.gate
        assert router.weight.dtype == torch.bfloat16 and not router.weight.requires_grad
        assert tuple(router.weight.shape) == (ex.num_experts, cfg.hidden_size)
        assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
        if gpt:
            assert layer.self_attn.sinks.dtype == torch.bfloat16 and not layer.self_attn.sinks.requires_grad
    trainable = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert trainable and all(".self_attn." in n and (".lora_A." in n or ".lora_B." in n) for n in trainable)
    assert not [n for n, t in pol.model.state_dict(keep_vars=True).items() if t.is_meta]
    ids = torch.randint(2, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = pol.model(ids).logits
    assert logits.shape == (2, 12, cfg.vocab_size) and torch.isfinite(logits).all()


def test_quantized_bytes_equal_the_step_plan(tiny):
    name, pol = tiny
    experts = sum(b.numel() * b.element_size() for m in pol.model.modules() if isinstance(m, QuantExperts)
                  for k, b in m.named_buffers() if not k.endswith("_bias"))
    attention = sum(t.numel() * t.element_size() for m in pol.model.modules() if isinstance(m, QLoRALinear)
                    for t in m.checkpoint_tensors().values())
    plan = plan_step(_shape(name), StepSettings())
    assert (plan.experts, plan.attention) == (experts, attention)


@pytest.mark.parametrize("name", list(MOE_SHAPES))
def test_real_configs_have_the_real_parameter_counts(name):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(moe_config(name))
        real = AutoModelForCausalLM.from_config(REAL[name]())
    assert _counts(model) == parameter_counts(MOE_SHAPES[name]) == _counts(real)
    assert _shape(name) == MOE_SHAPES[name]
    assert moe_config(name, 3).num_hidden_layers == 3


@pytest.mark.parametrize("name", list(TINY))
def test_chunked_experts_equal_the_whole_layer_quantized(name):
    """Generated and quantized a chunk of experts at a time (3 of 8, the last one short) into one [E, ...]
    storage: the same bytes as QuantExperts.quantize of the same draws over all experts at once."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(moe_config(name), dtype=torch.float32)
    sk = model.model.layers[0].mlp.experts
    fmt = TINY[name]
    got = random_experts(sk, fmt, "cpu", torch.Generator().manual_seed(5), 0.02, "x", chunk=3)
    g = torch.Generator().manual_seed(5)
    n = sk.gate_up_proj.shape[0]
    shapes = got.shapes
    biases = ({p: torch.randn((n, shapes[p][0]), generator=g).mul_(0.02) for p in PROJECTIONS}
              if sk.has_bias else None)
    parts = [[torch.randn((min(n, lo + 3) - lo, *shapes[p]), generator=g).mul_(0.02) for p in PROJECTIONS]
             for lo in range(0, n, 3)]
    ref = QuantExperts.quantize(*(torch.cat([pt[j] for pt in parts]) for j in range(2)), fmt, sk._apply_gate,
                                torch.float32, "x", biases, got.transposed)
    assert got.fmt.name == fmt and set(dict(got.named_buffers())) == set(dict(ref.named_buffers()))
    for k, b in ref.named_buffers():
        assert torch.equal(getattr(got, k).view(torch.uint8), b.view(torch.uint8)), k


def test_lora_on_experts_when_the_targets_name_them():
    pol = random_policy(moe_config("qwen3-moe-tiny"), "nvfp4", lora_rank=4, target_modules=("q", "v", "experts"),
                        device="cpu", dtype=torch.float32, progress=False)
    assert pol.target_modules == ("q", "v", "experts")
    ex = pol.model.model.layers[1].mlp.experts
    assert ex.r == 4 and all(p.requires_grad for p in ex.lora_A.values())
    assert not isinstance(pol.model.model.layers[1].self_attn.k_proj, QLoRALinear)


def _args(shape, extra=()):
    from test_bench_step import step_parser

    return step_parser().parse_args(["--shape", shape, "--device", "cpu", "--prompts", "2", "--num-generations", "4",
                          "--prompt-len", "8", "--max-new-tokens", "8", "--micro-batch", "4", "--optim", "adamw_torch",
                          "--steps", "1", *extra])


@pytest.mark.parametrize("shape", list(TINY))
def test_bench_step_runs_an_moe_step_and_updates_the_adapter(shape, tmp_path):
    a = _args(shape, ["--out", str(tmp_path)])
    pol, build_s = bstep.build_policy(a)
    assert all(isinstance(layer.mlp.experts, QuantExperts) for layer in pol.model.model.layers)
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters() if p.requires_grad}
    res = bstep.run_case(a, pol, build_s)
    assert res["fits"], res
    assert res["rows"] == 8 and 0 < res["new_tokens"] <= 8 * 8 and res["update_s"] > 0
    assert res["steps"][0]["grad_norm"] > 0  # groups of 4 on this seed: rewards differ within a group
    assert res["aqn"]  # every family, gpt-oss's (w * x_hat).to(dtype) norms included
    assert res["case"].startswith(f"{shape} nvfp4 2x4")
    changed = [n for n, p in pol.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert len(changed) == len(before)  # every attention adapter moved
