"""Our compressed-tensors checkpoints load in the tools users have, and back into qerl."""

import json

import pytest
import torch
from tiny_models import save_tiny

from qerl.checkpoint.compressed_tensors import save_compressed
from qerl.model import load_policy, quantized_layers


@pytest.fixture(params=["nvfp4", "mxfp4"])
def written(request, tmp_path):
    save_tiny(tmp_path / "dense", "qwen2")
    pol = load_policy(tmp_path / "dense", request.param, lora_rank=0, progress=False)
    out = save_compressed(pol, tmp_path / request.param)
    return request.param, pol, out


def test_config_validates_in_compressed_tensors(written):
    from compressed_tensors.quantization import QuantizationConfig

    fmt, _, out = written
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    cfg = QuantizationConfig.model_validate(q)  # pydantic, extra="forbid": unknown keys fail
    assert cfg.format == f"{fmt}-pack-quantized"
    assert q["ignore"] == ["lm_head"]


def test_transformers_loads_it_with_identical_logits(written):
    """transformers + compressed-tensors decompress our file; the model must equal ours exactly."""
    from transformers import AutoModelForCausalLM

    fmt, pol, out = written
    hf = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 160, (2, 11))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, pol.model(ids).logits)


def test_compressed_tensors_decompresses_to_our_weights(written):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    fmt, pol, out = written
    q = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    scheme = q.config_groups["group_0"]
    comp = BaseCompressor.load_from_registry(q.format)
    sd = load_file(out / "model.safetensors")
    for name, layer in quantized_layers(pol.model):
        local = {k.removeprefix(name + "."): v for k, v in sd.items() if k.startswith(name + ".")}
        w = comp.decompress(local, scheme)["weight"]
        assert torch.equal(w.to(torch.bfloat16), layer.dequantized_weight(torch.bfloat16)), name


def test_reload_into_qerl_is_byte_identical(written):
    fmt, pol, out = written
    again = load_policy(out, "auto", lora_rank=8, progress=False)
    assert again.quant == fmt
    a, b = dict(quantized_layers(pol.model)), dict(quantized_layers(again.model))
    for n in a:
        for k, t in a[n].quant_tensors().items():
            u = b[n].quant_tensors()[k]
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                               u.view(torch.uint8) if u.element_size() == 1 else u)
        assert (a[n].bias is None) == (b[n].bias is None)
        if a[n].bias is not None:
            assert torch.equal(a[n].bias, b[n].bias)
    with pytest.raises(ValueError, match=f"compressed-tensors {fmt} checkpoint; load it with quant='{fmt}'"):
        load_policy(out, "nf4", progress=False)


def test_bf16_fallback_layers_are_listed_in_ignore(tmp_path):
    save_tiny(tmp_path / "dense", "llama", intermediate_size=136)
    with pytest.warns(UserWarning):
        pol = load_policy(tmp_path / "dense", "nvfp4", lora_rank=0, progress=False)
    out = save_compressed(pol, tmp_path / "ct")
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.down_proj" in q["ignore"] and "lm_head" in q["ignore"]
    again = load_policy(out, "nvfp4", lora_rank=0, progress=False)
    assert again.model.model.layers[0].mlp.down_proj.fmt.name == "bf16"
    ids = torch.randint(0, 160, (1, 7))
    with torch.no_grad():
        assert torch.equal(again.model(ids).logits, pol.model(ids).logits)


def test_nf4_cannot_be_written_as_compressed_tensors(tmp_path):
    save_tiny(tmp_path / "dense", "llama")
    pol = load_policy(tmp_path / "dense", "nf4", lora_rank=0, progress=False)
    with pytest.raises(ValueError, match="no format for 'nf4'"):
        save_compressed(pol, tmp_path / "x")
