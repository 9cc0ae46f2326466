"""MoE checkpoints in compressed-tensors (llm-compressor's per-expert layout, what vLLM reads): qerl writes
its 4-bit experts that way and reads them back byte for byte with the same logits; the written config
validates in the real compressed-tensors package, which decompresses an expert to qerl's dequantized
weights; an expert whose gate and up global scales differ is refused by name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qerl.checkpoint.compressed_tensors import save_compressed
from qerl.layers.quant_experts import QuantExperts
from qerl.model import load_policy
from test_moe_experts import tiny_moe
from tiny_models import tiny_tokenizer


@pytest.fixture(params=["qwen3_moe", "mixtral"])
def written(request, tmp_path):
    tiny_moe(request.param).save_pretrained(tmp_path / "base")
    tiny_tokenizer().save_pretrained(tmp_path / "base")
    pol = load_policy(str(tmp_path / "base"), "nvfp4", lora_rank=0, dtype=torch.float32, progress=False)
    out = save_compressed(pol, tmp_path / "ct")
    return request.param, pol, out


def _experts(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantExperts)}


def test_read_back_byte_for_byte_with_equal_logits(written):
    family, pol, folder = written
    back = load_policy(str(folder), "auto", lora_rank=0, dtype=torch.float32, progress=False)
    assert back.quant == "nvfp4"
    a, b = _experts(pol.model), _experts(back.model)
    assert a.keys() == b.keys() and a
    for n in a:
        for (ka, ta), (kb, tb) in zip(sorted(a[n].named_buffers()), sorted(b[n].named_buffers())):
            assert ka == kb and torch.equal(ta.view(torch.uint8), tb.view(torch.uint8)), f"{n}.{ka}"
    ids = torch.randint(3, 150, (2, 10))
    with torch.no_grad():
        assert torch.equal(pol.model(ids).logits, back.model(ids).logits)
    keys = load_file(folder / "model.safetensors").keys()
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    gate = "w1" if family == "mixtral" else "gate_proj"
    assert f"model.layers.0.{block}.experts.3.{gate}.weight_packed" in keys  # the stock per-expert names


def test_compressed_tensors_decompresses_an_expert_to_our_weights(written):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    family, pol, folder = written
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    qc = QuantizationConfig.model_validate(cfg)
    comp = BaseCompressor.load_from_registry(qc.format)
    block, down = ("block_sparse_moe", "w2") if family == "mixtral" else ("mlp", "down_proj")
    name = f"model.layers.1.{block}.experts.2.{down}"
    files = load_file(folder / "model.safetensors")
    local = {k.removeprefix(name + "."): v for k, v in files.items() if k.startswith(name + ".")}
    theirs = comp.decompress(local, qc.config_groups["group_0"])["weight"]
    ours = _experts(pol.model)["model.layers.1.mlp.experts"].weight("down_proj", 2, torch.bfloat16)
    assert torch.equal(theirs.to(torch.bfloat16), ours)

def test_gate_and_up_with_different_global_scales_are_refused(written, tmp_path):
    family, _, folder = written
    files = load_file(folder / "model.safetensors")
    block, up = ("block_sparse_moe", "w3") if family == "mixtral" else ("mlp", "up_proj")
    key = f"model.layers.0.{block}.experts.5.{up}.weight_global_scale"
    files[key] = files[key] * 2
    save_file(files, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="expert 5's .* different weight_global_scale"):
        load_policy(str(folder), "auto", lora_rank=0, dtype=torch.float32, progress=False)
