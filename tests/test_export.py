"""export_merged: a dense HF folder that plain transformers loads, equal to the policy."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_models import save_tiny
from transformers import AutoModelForCausalLM, AutoTokenizer

from qerl.checkpoint import export_merged, load_adapter, save_adapter
from qerl.model import load_policy, quantized_layers

VOCAB = 160


def randomize_lora(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in quantized_layers(model):
            layer.lora_A.weight.copy_(torch.randn(layer.lora_A.weight.shape, generator=g) * 0.1)
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.05)


def logits(model):
    x = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return model(x).logits.float()


def policy(base, quant="nvfp4", rank=8):
    return load_policy(base, quant, lora_rank=rank, dtype=torch.float32, progress=False)


def save_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(folder)


@pytest.fixture(params=["llama", "qwen2"])  # qwen2: q/k/v carry biases
def base(request, tmp_path):
    save_tiny(tmp_path / "base", request.param)
    return tmp_path / "base"


def test_float32_export_matches_the_policy(base, tmp_path):
    pol = policy(base)
    randomize_lora(pol.model)
    out = export_merged(pol, tmp_path / "merged", dtype=torch.float32)
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == json.loads((base / "config.json").read_text())["architectures"]
    keys = set(load_file(out / "model.safetensors"))
    assert not any("lora" in k or "weight_packed" in k or "weight_scale" in k for k in keys)
    assert keys == set(load_file(base / "model.safetensors"))  # the dense model's own tensor names
    dense = AutoModelForCausalLM.from_pretrained(out)
    assert dense.dtype == torch.float32
    torch.testing.assert_close(logits(dense), logits(pol.model), rtol=1e-5, atol=1e-5)


def test_bf16_export_is_within_bf16_rounding(base, tmp_path):
    pol = policy(base)
    randomize_lora(pol.model)
    out = export_merged(pol, tmp_path / "merged")  # default: bfloat16
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    ref = logits(pol.model)
    dense = AutoModelForCausalLM.from_pretrained(out)
    assert dense.dtype == torch.bfloat16
    scale = ref.abs().max()
    torch.testing.assert_close(logits(dense), ref, rtol=0, atol=0.02 * scale)
    # In float32 only the weights' bf16 rounding remains (a relative 2^-9 per weight).
    dense32 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    torch.testing.assert_close(logits(dense32), ref, rtol=0, atol=0.004 * scale)
    f32 = AutoModelForCausalLM.from_pretrained(export_merged(pol, tmp_path / "f32", dtype=torch.float32))
    assert (logits(dense32) - ref).abs().max() > 10 * (logits(f32) - ref).abs().max()  # bf16 did round


def test_untouched_adapter_exports_the_dequantized_base(base, tmp_path):
    pol = policy(base)  # B = 0
    out = export_merged(pol, tmp_path / "merged", dtype=torch.float32)
    got, src = load_file(out / "model.safetensors"), load_file(base / "model.safetensors")
    for name, layer in quantized_layers(pol.model):
        assert torch.equal(got[f"{name}.weight"], layer.dequantized_weight(torch.float32)), name
        assert not torch.equal(got[f"{name}.weight"], src[f"{name}.weight"].float()), name  # nvfp4 did round
        if layer.bias is not None:
            assert torch.equal(got[f"{name}.bias"], src[f"{name}.bias"].float()), name
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(got[k], src[k].float()), k
    pol.model.model.layers[0].self_attn.q_proj.disable_adapters = True  # a no-op adapter: same logits either way
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out)), logits(pol.model), rtol=1e-5, atol=1e-5)


def test_large_exports_are_sharded(base, tmp_path):
    pol = policy(base)
    randomize_lora(pol.model)
    out = export_merged(pol, tmp_path / "merged", dtype=torch.float32, max_shard_bytes=64 << 10)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 3 and files == sorted(set(index["weight_map"].values()))
    assert not (out / "model.safetensors").exists()
    total = 0
    for fname in files:
        with safe_open(str(out / fname), "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == fname
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    assert total == index["metadata"]["total_size"]
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out)), logits(pol.model), rtol=1e-5, atol=1e-5)


def test_tied_embeddings(tmp_path):
    save_tiny(tmp_path / "base", "llama", tie_word_embeddings=True)
    pol = policy(tmp_path / "base")
    randomize_lora(pol.model)
    out = export_merged(pol, tmp_path / "merged", dtype=torch.float32)
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    dense = AutoModelForCausalLM.from_pretrained(out)
    assert dense.lm_head.weight.data_ptr() == dense.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(logits(dense), logits(pol.model), rtol=1e-5, atol=1e-5)


def test_tokenizer_copied_and_existing_folder_replaced(tmp_path):
    save_tiny(tmp_path / "base", "qwen2")
    save_tokenizer(tmp_path / "base")
    pol = policy(tmp_path / "base")
    assert pol.tokenizer is not None
    out = tmp_path / "merged"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    export_merged(pol, out)
    assert not (out / "stale.txt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("w5 w7")["input_ids"] == pol.tokenizer("w5 w7")["input_ids"]


def test_adapter_file_to_merged_export(base, tmp_path):
    """The `qerl export` path: a frozen base, an adapter folder, then the merge."""
    pol = policy(base)
    randomize_lora(pol.model)
    ad = save_adapter(pol, tmp_path / "adapter")
    frozen = policy(base, rank=0)
    load_adapter(frozen, ad)
    a = load_file(export_merged(pol, tmp_path / "a", dtype=torch.float32) / "model.safetensors")
    b = load_file(export_merged(frozen, tmp_path / "b", dtype=torch.float32) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
