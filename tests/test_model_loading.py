"""load_policy on small random Llama / Qwen2 / Qwen3 folders, through the real loading code."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny
from transformers import AutoModelForCausalLM

from qerl.formats import get_format
from qerl.layers import QLoRALinear
from qerl.model import load_policy, quantized_layers
from qerl.checkpoint.safetensors_reader import CheckpointError

FAMILIES = ["llama", "qwen2", "qwen3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_policy_matches_transformers(tmp_path, family):
    ref = save_tiny(tmp_path, family).float()
    pol = load_policy(tmp_path, "bf16", lora_rank=4, dtype=torch.float32, progress=False)
    ids = torch.randint(0, 160, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(pol.model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quant", ["nvfp4", "mxfp4", "nf4"])
def test_quantized_layers_hold_the_formats_bytes(tmp_path, family, quant):
    ref = save_tiny(tmp_path, family)
    pol = load_policy(tmp_path, quant, lora_rank=8, progress=False)
    fmt = get_format(quant)
    layers = dict(quantized_layers(pol.model))
    assert len(layers) == 7 * 2
    for i in range(2):
        att, mlp = ref.model.layers[i].self_attn, ref.model.layers[i].mlp
        groups = [[att.q_proj, att.k_proj, att.v_proj], [att.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]
        names = [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
        for g, ns in zip(groups, names):
            gs = fmt.global_scale([m.weight for m in g]) if fmt.has_global_scale else None
            for m, n in zip(g, ns):
                sub = "self_attn" if n[0] in "qkvo" else "mlp"
                layer = layers[f"model.layers.{i}.{sub}.{n}"]
                want = fmt.quantize(m.weight, gs)
                for k, t in layer.quant_tensors().items():
                    assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                                       want[k].view(torch.uint8) if want[k].element_size() == 1 else want[k]), (n, k)
                if m.bias is not None:
                    assert torch.equal(layer.bias, m.bias)
    # Only LoRA trains; embeddings, norms and lm_head stay dense and frozen.
    trainable = [n for n, p in pol.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 14
    assert torch.equal(pol.model.model.embed_tokens.weight, ref.model.embed_tokens.weight)
    assert torch.equal(pol.model.model.norm.weight, ref.model.norm.weight)
    assert not isinstance(pol.model.lm_head, QLoRALinear)


def test_nvfp4_shares_global_scale_in_fused_groups(tmp_path):
    save_tiny(tmp_path, "llama")
    pol = load_policy(tmp_path, "nvfp4", lora_rank=0, progress=False)
    att = pol.model.model.layers[0].self_attn
    mlp = pol.model.model.layers[0].mlp
    assert att.q_proj.weight_global_scale == att.k_proj.weight_global_scale == att.v_proj.weight_global_scale
    assert mlp.gate_proj.weight_global_scale == mlp.up_proj.weight_global_scale


def test_tied_embeddings_and_target_subset(tmp_path):
    save_tiny(tmp_path, "llama", tie_word_embeddings=True)
    pol = load_policy(tmp_path, "nvfp4", lora_rank=4, target_modules=["q_proj", "v"], progress=False)
    assert pol.model.lm_head.weight.data_ptr() == pol.model.model.embed_tokens.weight.data_ptr()
    names = [n.rsplit(".", 1)[-1] for n, _ in quantized_layers(pol.model)]
    assert sorted(set(names)) == ["q_proj", "v_proj"]
    assert isinstance(pol.model.model.layers[0].mlp.down_proj, torch.nn.Linear)


def test_bad_layers_stay_bf16_with_a_warning(tmp_path):
    save_tiny(tmp_path, "llama", intermediate_size=136)  # down_proj in=136: not a multiple of 16
    with pytest.warns(UserWarning) as rec:
        pol = load_policy(tmp_path, "nvfp4", lora_rank=4, progress=False)
    msgs = " ".join(str(w.message) for w in rec)
    assert "model.layers.0.mlp.down_proj" in msgs and "not divisible" in msgs
    assert pol.model.model.layers[0].mlp.down_proj.fmt.name == "bf16"
    assert pol.model.model.layers[0].mlp.down_proj.r == 4  # still gets its adapter
    assert pol.model.model.layers[0].mlp.up_proj.fmt.name == "nvfp4"
    assert set(pol.bf16_fallback) == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}


def test_a_nonfinite_base_weight_is_refused_by_layer(tmp_path):
    """NaN in a base weight: not kept in bf16 to generate nothing and pass the parity gate (issue 50), refused."""
    from qerl.formats.base import NonFiniteWeightError

    save_tiny(tmp_path, "llama")
    sd = load_file(tmp_path / "model.safetensors")
    sd["model.layers.1.self_attn.o_proj.weight"][3, 3] = float("nan")
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for quant in ("nvfp4", "bf16"):
        with pytest.raises(NonFiniteWeightError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight holds NaN"):
            load_policy(tmp_path, quant, lora_rank=4, progress=False)


def test_unsupported_architecture(tmp_path):
    save_tiny(tmp_path, "llama")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_policy(tmp_path, progress=False)


def test_truncated_file(tmp_path):
    save_tiny(tmp_path, "llama")
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_policy(tmp_path, progress=False)


def test_missing_and_misshapen_tensors(tmp_path):
    save_tiny(tmp_path, "llama")
    sd = load_file(tmp_path / "model.safetensors")
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_policy(tmp_path, progress=False)
    sd = load_file(tmp_path / "model.safetensors") | {"model.layers.1.mlp.up_proj.weight": torch.zeros(128, 64)}
    sd["model.norm.weight"] = torch.ones(65)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.norm.weight.*\[65\].*\[64\]"):
        load_policy(tmp_path, progress=False)


def test_pickles_are_refused(tmp_path):
    save_tiny(tmp_path, "llama")
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pytorch_model.bin.*not read"):
        load_policy(tmp_path, progress=False)


def test_sharded_checkpoint(tmp_path):
    model = save_tiny(tmp_path / "one", "qwen2")
    model.save_pretrained(tmp_path / "many", max_shard_size="50KB")
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    a = load_policy(tmp_path / "one", "nvfp4", lora_rank=0, progress=False)
    b = load_policy(tmp_path / "many", "nvfp4", lora_rank=0, progress=False)
    for (n, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x,
                           y.view(torch.uint8) if y.element_size() == 1 else y), n
