"""gpt-oss on a tiny random model in its stock MXFP4 layout (experts' `*_blocks` / `*_scales` from random
bytes, the rest bf16, quantization_config {"quant_method": "mxfp4"}), against transformers' own
dequantization of that checkpoint and its eager GptOss modules (attention sinks, alternating sliding
windows of 8, yarn rotary, clamped interleaved gating, expert and router biases)."""

import json
import warnings

import pytest
import torch
import transformers as tf
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from qerl.checkpoint import save_adapter
from qerl.checkpoint.export import export_merged
from qerl.checkpoint.mxfp4_experts import save_mxfp4_experts
from qerl.layers import QLoRALinear
from qerl.layers.quant_experts import QuantExperts
from qerl.model import load_policy, quantized_layers
from test_families import PROMPTS, engine_greedy, hf_greedy

LABEL = {"quant_method": "mxfp4",
         "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                    "lm_head"]}


def gpt_oss_config(**kw):
    return tf.GptOssConfig(vocab_size=160, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_hidden_layers=2, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                           rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                            "truncate": False, "original_max_position_embeddings": 8,
                                            "rope_theta": 150000.0},
                           pad_token_id=0, bos_token_id=1, eos_token_id=1, **kw)


def write_stock_mxfp4(path, seed=0):
    """A checkpoint as gpt-oss ships: experts fused and MXFP4 (random codes, E8M0 exponents 121..126)."""
    torch.manual_seed(seed)
    cfg = gpt_oss_config()
    shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, shape in shapes.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, k_in, n = shape  # transformers holds them [E, K, N]; the checkpoint [E, N, K/32, 16]
            out[k + "_blocks"] = torch.randint(0, 256, (e, n, k_in // 32, 16), generator=g, dtype=torch.uint8)
            out[k + "_scales"] = torch.randint(121, 127, (e, n, k_in // 32), generator=g, dtype=torch.uint8)
        else:
            out[k] = (torch.randn(shape, generator=g) * 0.08).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    d = cfg.to_dict()
    d.update(quantization_config=LABEL, architectures=["GptOssForCausalLM"])
    (path / "config.json").write_text(json.dumps(d))
    return out


def hf_dequantized(path, **config_changes):
    """transformers' own reading of the MXFP4 checkpoint: dequantized experts, eager loop and attention."""
    cfg = tf.AutoConfig.from_pretrained(path)
    for k, v in config_changes.items():
        setattr(cfg, k, v)
    return AutoModelForCausalLM.from_pretrained(path, config=cfg, quantization_config=tf.Mxfp4Config(dequantize=True),
                                                dtype=torch.float32, experts_implementation="eager").eval()


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    return root, write_stock_mxfp4(root / "stock")


def test_mxfp4_checkpoint_round_trips_byte_for_byte(stock, tmp_path):
    root, tensors = stock
    pol = load_policy(str(root / "stock"), "bf16", lora_rank=4, dtype=torch.bfloat16, progress=False)
    q = pol.model.model.layers[0].mlp.experts
    assert isinstance(q, QuantExperts) and q.fmt.name == "mxfp4"  # repacked, whatever quant the rest takes
    save_mxfp4_experts(pol, tmp_path / "out")
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(written) == sorted(tensors)
    for k, t in tensors.items():
        assert written[k].dtype == t.dtype and written[k].shape == t.shape, k
        assert torch.equal(written[k].view(torch.uint8), t.view(torch.uint8)), k
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"] == LABEL


@pytest.fixture(scope="module")
def loaded(stock):
    root, _ = stock
    pol = load_policy(str(root / "stock"), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return root, pol


def test_policy_is_4bit_with_routers_sinks_and_norms_untouched(stock, loaded):
    _, tensors = stock
    _, pol = loaded
    for i, layer in enumerate(pol.model.model.layers):
        assert isinstance(layer.mlp.experts, QuantExperts) and layer.mlp.experts.fmt.name == "mxfp4"
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert isinstance(getattr(layer.self_attn, p), QLoRALinear) and getattr(layer.self_attn, p).fmt.name == "nvfp4"
        for name in ("self_attn.sinks", "mlp.router.weight", "mlp.router.bias", "input_layernorm.weight"):
            assert torch.equal(pol.model.get_parameter(f"model.layers.{i}.{name}"),
                               tensors[f"model.layers.{i}.{name}"].float()), name
    assert pol.target_modules == ("q", "k", "v", "o")


def test_engine_greedy_equals_transformers_on_the_dequantized_checkpoint(stock):
    """No LoRA, attention kept dense: the engine on the repacked experts gives transformers' tokens on its
    own dequantization of the same bytes; with windows longer than the text, transformers' tokens differ."""
    root, _ = stock
    pol = load_policy(str(root / "stock"), "bf16", lora_rank=0, dtype=torch.float32, progress=False)
    got = engine_greedy(pol.model)
    ref = hf_dequantized(root / "stock")
    assert got == [hf_greedy(ref, p) for p in PROMPTS]
    assert got != [hf_greedy(hf_dequantized(root / "stock", sliding_window=10**6), p) for p in PROMPTS]
    sinkless = hf_dequantized(root / "stock")
    with torch.no_grad():
        for layer in sinkless.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
    assert got != [hf_greedy(sinkless, p) for p in PROMPTS]  # the sinks matter too


def test_engine_greedy_equals_hf_generate_with_live_lora(loaded):
    root, pol = loaded
    got = engine_greedy(pol.model)
    assert got == [hf_greedy(pol.model, p) for p in PROMPTS]
    export_merged(pol, root / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32,
                                                  experts_implementation="eager").eval()
    assert got == [hf_greedy(merged, p) for p in PROMPTS]


def sevens(completions, **_):
    return [sum(map(ord, c)) % 7 / 7 for c in completions]


def test_one_grpo_step_changes_the_adapter_and_peft_loads_it(stock, tmp_path):
    from peft import PeftModel

    from qerl.rl import GRPOConfig, GRPOTrainer
    from qerl.tasks import get_task
    from tiny_models import tiny_tokenizer

    root, _ = stock
    tiny_tokenizer().save_pretrained(root / "stock")
    pol = load_policy(str(root / "stock"), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False)
    cfg = GRPOConfig(max_steps=1, generation_batch_size=8, num_generations=4, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, max_completion_length=12, max_prompt_length=64,
                     learning_rate=1e-2, aqn=True, output_dir=str(tmp_path / "run"), save_steps=1,
                     report_to="none", device="cpu", dynamic_sampling=False)
    tr = GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=16), reward_funcs=[sevens], progress=False)
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters() if p.requires_grad}
    tr.train()
    assert any(not torch.equal(before[n], p.detach()) for n, p in pol.model.named_parameters() if p.requires_grad)
    ad = save_adapter(pol, tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(hf_dequantized(root / "stock"), ad)
    bad = [str(w.message) for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    assert not bad, bad
    for name, layer in quantized_layers(pol.model):
        theirs = pm.base_model.model.get_submodule(name)
        assert torch.equal(theirs.lora_B["default"].weight, layer.lora_B.weight), name


def test_a_dense_checkpoint_loads_its_transposed_experts(tmp_path):
    """gpt-oss saved dense by transformers (experts [E, K, N], as the BF16 re-uploads hold them): quantized
    along K, per expert; the engine's greedy tokens equal HF generate on the merged export."""
    from qerl.formats import get_format

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(gpt_oss_config()).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.08)
    ref.save_pretrained(tmp_path / "dense")
    pol = load_policy(str(tmp_path / "dense"), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False)
    q, w = pol.model.model.layers[1].mlp.experts, ref.model.layers[1].mlp.experts.down_proj
    fmt = get_format("nvfp4")
    t = fmt.quantize(w[2].t(), fmt.global_scale([w[2].t()]))
    assert all(torch.equal(t[k].view(torch.uint8), q.tensors("down_proj", 2)[k].view(torch.uint8)) for k in t)
    assert torch.equal(q.bias("down_proj"), ref.model.layers[1].mlp.experts.down_proj_bias)
    export_merged(pol, tmp_path / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                  experts_implementation="eager").eval()
    assert engine_greedy(pol.model) == [hf_greedy(merged, p) for p in PROMPTS]
