"""load_policy reads the tensors, not the label (issue 21.3): folders written by transformers'
save_pretrained load whatever a stale quantization_config says; tensors really quantized in a
format qerl does not read are refused by name."""

import copy
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny

from qerl.model import load_policy

READS = "qerl reads dense float weights"


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))
    return cfg


def _assert_same_logits(folder, ref):
    """qerl's dense load of the folder computes what the model that wrote it computes (with the
    projections in bf16, the storage of qerl's "bf16" format; everything else in fp32)."""
    pol = load_policy(folder, "bf16", lora_rank=0, dtype=torch.float32, progress=False)
    ref = copy.deepcopy(ref).float()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("_proj.weight"):
                p.copy_(p.to(torch.bfloat16))
    ids = torch.randint(0, 160, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(pol.model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)
    return pol


STALE = {
    "gguf": {"quant_method": "gguf"},  # what a folder saved after a GGUF load carries
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                           "quantization_status": "compressed", "config_groups": {}},
}


@pytest.mark.parametrize("method", list(STALE))
def test_a_stale_label_over_dense_weights_loads_with_a_note(tmp_path, method, caplog):
    ref = save_tiny(tmp_path, "llama")
    _edit_config(tmp_path, quantization_config=STALE[method])
    with caplog.at_level(logging.WARNING, logger="qerl.checkpoint.detect"):
        _assert_same_logits(tmp_path, ref)
    note = " ".join(r.getMessage() for r in caplog.records)
    assert repr(method) in note and "dense BF16" in note and "config.json" in note
    pol = load_policy(tmp_path, "auto", lora_rank=4, progress=False)  # "auto" on dense weights: nvfp4
    assert pol.quant == "nvfp4"


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype_key", ["dtype", "torch_dtype"])
def test_sharded_stale_label_either_dtype_key_tied_or_not(tmp_path, tied, dtype_key):
    ref = save_tiny(tmp_path / "one", "qwen2", tie_word_embeddings=tied)
    ref.save_pretrained(tmp_path / "many", max_shard_size="50KB")
    folder = tmp_path / "many"
    assert (folder / "model.safetensors.index.json").exists()
    assert ("lm_head.weight" in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) \
        != tied
    cfg = json.loads((folder / "config.json").read_text())
    dt = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
    _edit_config(folder, **{"dtype": None, "torch_dtype": None, "quantization_config": STALE["gguf"], dtype_key: dt})
    pol = _assert_same_logits(folder, ref)
    tied_now = pol.model.lm_head.weight.data_ptr() == pol.model.model.embed_tokens.weight.data_ptr()
    assert tied_now == tied


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_tensors_load(tmp_path, dtype):
    ref = save_tiny(tmp_path, "qwen3", dtype=dtype)
    _assert_same_logits(tmp_path, ref)


def _bnb_folder(tmp_path, bits):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    save_tiny(tmp_path / "dense", "llama", dtype=torch.float32)
    q = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4") if bits == 4
         else BitsAndBytesConfig(load_in_8bit=True))
    try:
        m = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=q, device_map="cpu")
    except Exception as e:  # a bitsandbytes build without CPU support
        pytest.skip(f"bitsandbytes cannot quantize on this machine: {e}")
    m.save_pretrained(tmp_path / "bnb")
    return tmp_path / "bnb"


@pytest.mark.parametrize("bits,name", [(4, "bitsandbytes 4-bit"), (8, "bitsandbytes 8-bit")])
def test_bitsandbytes_folders_are_refused_by_name(tmp_path, bits, name):
    folder = _bnb_folder(tmp_path, bits)
    with pytest.raises(ValueError, match=f"quantized as {name}.*{READS}.*compressed-tensors nvfp4"):
        load_policy(folder, "auto", progress=False)
    _edit_config(folder, quantization_config=None)  # the tensors decide, not the label
    with pytest.raises(ValueError, match=name):
        load_policy(folder, "auto", progress=False)


def _fake_gptq(folder, with_g_idx, label):
    """Replace every projection's weight by GPTQ/AWQ-packed tensors (int32 qweight/qzeros, fp16 scales),
    with the shapes AutoGPTQ / AutoAWQ write, and label config.json accordingly."""
    path = folder / "model.safetensors"
    sd = load_file(path)
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        out_f, in_f = sd.pop(k).shape
        base = k[: -len(".weight")]
        sd[f"{base}.qweight"] = torch.zeros(in_f // 8, out_f, dtype=torch.int32)
        sd[f"{base}.qzeros"] = torch.zeros(1, out_f // 8, dtype=torch.int32)
        sd[f"{base}.scales"] = torch.ones(1, out_f, dtype=torch.float16)
        if with_g_idx:
            sd[f"{base}.g_idx"] = torch.zeros(in_f, dtype=torch.int32)
    save_file(sd, path, metadata={"format": "pt"})
    if label:
        _edit_config(folder, quantization_config={"quant_method": label, "bits": 4, "group_size": 64})


@pytest.mark.parametrize("g_idx,label,name", [(True, "gptq", "GPTQ"), (False, "awq", "AWQ"), (True, None, "GPTQ"),
                                              (False, None, "AWQ"), (True, "gguf", "GPTQ")])
def test_gptq_and_awq_tensors_are_refused_by_name(tmp_path, g_idx, label, name):
    save_tiny(tmp_path, "llama")
    _fake_gptq(tmp_path, g_idx, label)
    with pytest.raises(ValueError, match=f"{tmp_path}: the weights are quantized as {name} \\(qweight.*{READS}"):
        load_policy(tmp_path, "auto", progress=False)


def test_fp8_and_unnamed_integer_weights_are_refused(tmp_path):
    save_tiny(tmp_path, "llama")
    path = tmp_path / "model.safetensors"
    dense = load_file(path)
    sd = dict(dense)
    for k in [k for k in sd if k.endswith("_proj.weight")]:
        sd[k] = sd[k].to(torch.float8_e4m3fn)
        sd[k.replace(".weight", ".weight_scale_inv")] = torch.ones(1, 1)
    save_file(sd, path, metadata={"format": "pt"})
    _edit_config(tmp_path, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match=f"FP8.*{READS}"):
        load_policy(tmp_path, "auto", progress=False)
    sd = {k: (v.to(torch.int8) if k.endswith("_proj.weight") else v) for k, v in dense.items()}
    save_file(sd, path, metadata={"format": "pt"})
    _edit_config(tmp_path, quantization_config=None)
    unnamed = "a format config.json does not name \\(projection weights stored as I8\\)"
    with pytest.raises(ValueError, match=f"{unnamed}.*{READS}"):
        load_policy(tmp_path, "auto", progress=False)


def test_packed_tensors_need_their_compressed_tensors_label(tmp_path):
    from qerl.checkpoint.compressed_tensors import save_compressed

    save_tiny(tmp_path / "dense", "qwen2")
    out = save_compressed(load_policy(tmp_path / "dense", "nvfp4", lora_rank=0, progress=False), tmp_path / "ct")
    assert load_policy(out, "auto", lora_rank=0, progress=False).quant == "nvfp4"  # the real label: loads
    _edit_config(out, quantization_config=STALE["gguf"])
    with pytest.raises(ValueError, match="weight_packed.*'gguf', not 'compressed-tensors'"):
        load_policy(out, "auto", progress=False)
