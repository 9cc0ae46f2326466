"""A policy with the 4-bit lm_head (lm_head_4bit: model.lm_head is a QuantHead wrapping a QLoRALinear at
`lm_head.layer`) written by each checkpoint writer: the head goes under the name transformers reads
(`lm_head.weight`, or llm-compressor's `lm_head.weight_packed` / `weight_scale` / `weight_global_scale`), and
the folder loaded by transformers scores tokens as the policy does, with the 4-bit head the policy used."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import save_tiny
from transformers import AutoModelForCausalLM

from qerl.checkpoint.compressed_tensors import save_compressed
from qerl.checkpoint.export import export_merged
from qerl.checkpoint.mxfp4_experts import save_mxfp4_experts
from qerl.checkpoint.safetensors_reader import CheckpointError
from qerl.layers.quant_head import QuantHead, quantize_lm_head
from qerl.model import load_policy, quantized_layers

VOCAB = 160


def ids():
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))


def logits(model):
    with torch.no_grad():
        return model(ids()).logits.float()


def head4_policy(folder, quant="nvfp4", rank=8, dtype=torch.float32):
    """A policy as a run with lm_head_4bit holds it, its LoRA nonzero."""
    pol = load_policy(folder, quant, lora_rank=rank, dtype=dtype, progress=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, layer in quantized_layers(pol.model) if rank else ():
            layer.lora_A.weight.copy_(torch.randn(layer.lora_A.weight.shape, generator=g) * 0.1)
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.05)
    assert isinstance(quantize_lm_head(pol.model), QuantHead)
    return pol


def assert_head_is_the_4bit_one(dense, pol, dense_head_of_base):
    """The loaded head is the policy's 4-bit head, not the base's dense one nor a random one."""
    got = dense.lm_head.weight.detach().float()
    want = pol.model.lm_head.weight.detach().float()
    torch.testing.assert_close(got, want, rtol=0, atol=want.abs().max() * 2 ** -7)
    assert (got - dense_head_of_base.float()).abs().max() > 10 * (got - want).abs().max()


@pytest.mark.parametrize("tied", [False, True])
def test_merged_export_writes_the_4bit_head_as_lm_head_weight(tmp_path, tied):
    save_tiny(tmp_path / "base", "llama", tie_word_embeddings=tied)
    src = load_file(tmp_path / "base" / "model.safetensors")
    base_head = src["model.embed_tokens.weight" if tied else "lm_head.weight"]
    pol = head4_policy(tmp_path / "base")
    ref = logits(pol.model)

    out = export_merged(pol, tmp_path / "f32", dtype=torch.float32)
    keys = set(load_file(out / "model.safetensors"))
    assert "lm_head.weight" in keys and not any(k.startswith("lm_head.layer") for k in keys)
    assert keys == set(src) | {"lm_head.weight"}  # the dense model's own names (a tied base: its head written)
    dense, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if tied:  # the policy's head is the 4-bit copy, its embedding the dense table: no longer one tensor
        assert dense.config.tie_word_embeddings is False
        assert dense.lm_head.weight.data_ptr() != dense.model.embed_tokens.weight.data_ptr()
        torch.testing.assert_close(dense.model.embed_tokens.weight, src["model.embed_tokens.weight"].float())
    assert_head_is_the_4bit_one(dense, pol, base_head)
    torch.testing.assert_close(logits(dense), ref, rtol=1e-5, atol=1e-5)

    out = export_merged(pol, tmp_path / "bf16")  # the default: bf16, the head's 4-bit values rounded once more
    dense = AutoModelForCausalLM.from_pretrained(out)
    assert dense.lm_head.weight.dtype == torch.bfloat16
    assert_head_is_the_4bit_one(dense, pol, base_head)
    torch.testing.assert_close(logits(dense), ref, rtol=0, atol=0.02 * ref.abs().max())


def test_compressed_tensors_writes_the_head_packed_as_llm_compressor_names_it(tmp_path):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    save_tiny(tmp_path / "base", "qwen2")
    pol = head4_policy(tmp_path / "base", rank=0, dtype=torch.bfloat16)
    out = save_compressed(pol, tmp_path / "ct")
    sd = load_file(out / "model.safetensors")
    assert {k for k in sd if k.startswith("lm_head.")} == {"lm_head.weight_packed", "lm_head.weight_scale",
                                                           "lm_head.weight_global_scale"}
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "lm_head" not in q["ignore"]
    # compressed-tensors' own decompression of those tensors is the head the policy holds, exactly
    cfg = QuantizationConfig.model_validate(q)
    comp = BaseCompressor.load_from_registry(cfg.format)
    local = {k.removeprefix("lm_head."): v for k, v in sd.items() if k.startswith("lm_head.")}
    w = comp.decompress(local, cfg.config_groups["group_0"])["weight"]
    assert torch.equal(w.to(torch.bfloat16), pol.model.lm_head.weight)
    # and transformers (with compressed-tensors; it keeps the layers packed) loads it with the policy's logits
    hf, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = logits(pol.model)
    torch.testing.assert_close(logits(hf), ref, rtol=0, atol=0.02 * ref.abs().max())


def test_compressed_tensors_of_a_tied_model_unties_the_head(tmp_path):
    save_tiny(tmp_path / "base", "llama", tie_word_embeddings=True)
    pol = head4_policy(tmp_path / "base", rank=0, dtype=torch.bfloat16)
    out = save_compressed(pol, tmp_path / "ct")
    assert "lm_head.weight_packed" in load_file(out / "model.safetensors")
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.config.tie_word_embeddings is False
    ref = logits(pol.model)
    torch.testing.assert_close(logits(hf), ref, rtol=0, atol=0.02 * ref.abs().max())


def test_a_head_in_a_kernel_layout_is_written_in_the_checkpoint_layout(tmp_path):
    """humming's layout (the CPU holds it when asked; a GPU holds a kernel's layout by default): the head's
    tensors go through checkpoint_tensors, the bytes of the same head quantized in the standard layout."""
    from qerl.formats.nvfp4_humming import NVFP4Humming
    from qerl.kernels import settings

    save_tiny(tmp_path / "base", "qwen2", vocab_size=256)  # humming tiles want rows % 128
    pol = load_policy(tmp_path / "base", "nvfp4", lora_rank=0, dtype=torch.bfloat16, progress=False)
    std = QuantHead.from_linear(pol.model.lm_head)  # the standard layout: the reference bytes
    with settings.use(humming_storage=True):
        assert isinstance(quantize_lm_head(pol.model).layer.fmt, NVFP4Humming)
    out = save_compressed(pol, tmp_path / "ct")
    sd = load_file(out / "model.safetensors")
    want = std.layer.checkpoint_tensors()
    assert {k for k in sd if k.startswith("lm_head.")} == {f"lm_head.{k}" for k in want}
    for k, t in want.items():
        assert torch.equal(sd[f"lm_head.{k}"].view(torch.uint8), t.view(torch.uint8)), k
    x = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, ref = AutoModelForCausalLM.from_pretrained(out)(x).logits.float(), pol.model(x).logits.float()
    torch.testing.assert_close(got, ref, rtol=0, atol=0.02 * ref.abs().max())


@pytest.mark.parametrize("tied", [False, True])
def test_qerl_reads_back_the_compressed_head(tmp_path, tied):
    """qerl's own loader reads the packed head as the policy's QuantHead, the same bytes: the same logits."""
    save_tiny(tmp_path / "base", "llama" if tied else "qwen2", tie_word_embeddings=tied)
    pol = head4_policy(tmp_path / "base", rank=0, dtype=torch.bfloat16)
    again = load_policy(save_compressed(pol, tmp_path / "ct"), "auto", lora_rank=0, progress=False)
    assert isinstance(again.model.lm_head, QuantHead) and not again.model.lm_head.layer.r
    assert torch.equal(again.model.lm_head.weight, pol.model.lm_head.weight)
    assert torch.equal(logits(again.model), logits(pol.model))


def test_qerl_reads_the_packed_head_of_a_config_that_still_ties_it(tmp_path):
    """A folder whose config says tie_word_embeddings but holds a packed head: the head is those bytes, never
    re-tied to the embedding table."""
    save_tiny(tmp_path / "base", "llama", tie_word_embeddings=True)
    pol = head4_policy(tmp_path / "base", rank=0, dtype=torch.bfloat16)
    out = save_compressed(pol, tmp_path / "ct")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    again = load_policy(out, "auto", lora_rank=0, progress=False)
    assert torch.equal(again.model.lm_head.weight, pol.model.lm_head.weight)
    assert torch.equal(logits(again.model), logits(pol.model))


def _rewrite(folder, change):
    """The folder's single safetensors file with `change(tensors)` applied."""
    from safetensors.torch import save_file

    sd = load_file(folder / "model.safetensors")
    change(sd)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("change, words", [
    (lambda sd: sd.__setitem__("lm_head.weight_scale", sd["lm_head.weight_scale"][:, :-1].contiguous()),
     "tensor 'lm_head.weight_scale' has shape"),
    (lambda sd: sd.__setitem__("lm_head.weight_scale", sd["lm_head.weight_scale"].view(torch.uint8)),
     "tensor 'lm_head.weight_scale' is torch.uint8"),
    (lambda sd: sd.__setitem__("lm_head.weight_packed", sd["lm_head.weight_packed"][:-16].contiguous()),
     "tensor 'lm_head.weight_packed' holds a head of [144, 64]"),
    (lambda sd: sd.pop("lm_head.weight_global_scale"), "missing tensor lm_head.weight_global_scale"),
])
def test_a_bad_packed_head_is_refused_naming_the_file_and_tensor(tmp_path, change, words):
    save_tiny(tmp_path / "base", "qwen2")
    out = save_compressed(head4_policy(tmp_path / "base", rank=0, dtype=torch.bfloat16), tmp_path / "ct")
    _rewrite(out, change)
    with pytest.raises(CheckpointError) as e:
        load_policy(out, "auto", lora_rank=0, progress=False)
    assert str(e.value).startswith(str(out)) and words in str(e.value), e.value


def test_mxfp4_compressed_writes_a_4bit_nvfp4_head_dense_and_ignored(tmp_path):
    """An mxfp4 policy's head is NVFP4 (lm_head_4bit's format), which an MXFP4 checkpoint cannot hold packed:
    it is written as the dense values the policy uses, listed in ignore."""
    save_tiny(tmp_path / "base", "qwen2")
    base_head = load_file(tmp_path / "base" / "model.safetensors")["lm_head.weight"]
    pol = head4_policy(tmp_path / "base", "mxfp4", rank=0, dtype=torch.bfloat16)
    out = save_compressed(pol, tmp_path / "ct")
    sd = load_file(out / "model.safetensors")
    assert {k for k in sd if k.startswith("lm_head.")} == {"lm_head.weight"}
    assert "lm_head" in json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    hf = AutoModelForCausalLM.from_pretrained(out)
    assert_head_is_the_4bit_one(hf, pol, base_head)
    ref = logits(pol.model)
    torch.testing.assert_close(logits(hf), ref, rtol=0, atol=0.02 * ref.abs().max())
    again = load_policy(out, "auto", lora_rank=0, progress=False)  # a dense head: qerl reads it too
    torch.testing.assert_close(logits(again.model), ref, rtol=0, atol=0.02 * ref.abs().max())


def test_gpt_oss_mxfp4_layout_writes_the_4bit_head_as_lm_head_weight(tmp_path):
    from test_gpt_oss import hf_dequantized, write_stock_mxfp4

    stock = write_stock_mxfp4(tmp_path / "stock")
    pol = load_policy(str(tmp_path / "stock"), "bf16", lora_rank=0, dtype=torch.float32, progress=False)
    quantize_lm_head(pol.model)
    out = save_mxfp4_experts(pol, tmp_path / "out")
    keys = set(load_file(out / "model.safetensors"))
    assert keys == set(stock)  # gpt-oss's own names
    hf = hf_dequantized(out)
    assert_head_is_the_4bit_one(hf, pol, stock["lm_head.weight"])
    ref = logits(pol.model)
    torch.testing.assert_close(logits(hf), ref, rtol=0, atol=0.02 * ref.abs().max())


def test_keeping_a_packed_head_in_bf16_is_refused(tmp_path):
    save_tiny(tmp_path / "base", "qwen2")
    out = save_compressed(head4_policy(tmp_path / "base", rank=0, dtype=torch.bfloat16), tmp_path / "ct")
    with pytest.raises(ValueError, match="modules_to_not_convert: lm_head is quantized in"):
        load_policy(out, "auto", lora_rank=0, progress=False, modules_to_not_convert=["lm_head"])


def test_all_linear_leaves_a_4bit_head_untargeted_as_peft_leaves_lm_head():
    """PEFT's "all-linear" never targets the output head; a 4-bit head's linear sits at lm_head.layer."""
    from qerl.checkpoint.peft_adapter import _matches_targets

    cfg = {"target_modules": "all-linear"}
    assert not _matches_targets(cfg, "lm_head") and not _matches_targets(cfg, "lm_head.layer")
    assert _matches_targets(cfg, "model.layers.0.self_attn.q_proj")
