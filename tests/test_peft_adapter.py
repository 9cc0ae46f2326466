"""save_adapter / load_adapter: PEFT's file format, checked against PEFT itself."""

import json
import math
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny
from transformers import AutoModelForCausalLM

from qerl.checkpoint import AdapterError, load_adapter, save_adapter
from qerl.model import load_policy, quantized_layers

FAMILIES = ["llama", "qwen2"]  # qwen2: q/k/v carry biases
VOCAB = 160


def randomize_lora(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in quantized_layers(model):
            layer.lora_A.weight.copy_(torch.randn(layer.lora_A.weight.shape, generator=g) * 0.1)
            layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.05)


def ids(seed=2):
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))


def logits(model, x=None):
    with torch.no_grad():
        return model(ids() if x is None else x).logits


def policy(base, quant="nvfp4", rank=8, **kw):
    return load_policy(base, quant, lora_rank=rank, dtype=torch.float32, progress=False, **kw)


@pytest.fixture(params=FAMILIES)
def base(request, tmp_path):
    save_tiny(tmp_path / "base", request.param)
    return tmp_path / "base"


@pytest.fixture
def trained(base, tmp_path):
    """(policy, adapter folder): nvfp4, r=8, alpha=32, random non-zero A and B."""
    pol = policy(base, lora_alpha=32)
    randomize_lora(pol.model)
    return pol, save_adapter(pol, tmp_path / "adapter")


def peft_model(base, adapter_dir):
    from peft import PeftModel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter_dir)
    bad = [str(w.message) for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    assert not bad, bad
    return pm.eval()


# ---- our own round trip --------------------------------------------------------------------


def test_files_are_peft_format(trained):
    pol, ad = trained
    # PEFT's two files, and qerl's record of the base format (PEFT's config has no field for it)
    assert sorted(p.name for p in ad.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                    "qerl_adapter.json"]
    assert json.loads((ad / "qerl_adapter.json").read_text()) == {"base_quant": pol.quant}
    cfg = json.loads((ad / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert (cfg["r"], cfg["lora_alpha"], cfg["bias"], cfg["use_rslora"], cfg["revision"]) == (8, 32, "none", False, None)
    assert cfg["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert cfg["base_model_name_or_path"] == str(pol.source)
    with safe_open(str(ad / "adapter_model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        keys = set(f.keys())
    want = {f"base_model.model.{n}.lora_{x}.weight" for n, _ in quantized_layers(pol.model) for x in "AB"}
    assert keys == want and len(keys) == 2 * 7 * 2

    from peft import LoraConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unknown key would warn
        lc = LoraConfig.from_pretrained(str(ad))
    assert (lc.r, lc.lora_alpha, set(lc.target_modules), lc.use_rslora) == (8, 32, set(cfg["target_modules"]), False)


def test_round_trip_into_a_fresh_policy(trained, base):
    pol, ad = trained
    fresh = policy(base)  # alpha 16, B = 0, another random A
    assert not torch.equal(logits(fresh.model), logits(pol.model))
    load_adapter(fresh, ad)
    ours, theirs = dict(quantized_layers(pol.model)), dict(quantized_layers(fresh.model))
    for n, layer in ours.items():
        assert torch.equal(theirs[n].lora_A.weight, layer.lora_A.weight), n
        assert torch.equal(theirs[n].lora_B.weight, layer.lora_B.weight), n
        assert theirs[n].scaling == layer.scaling == 4.0
        assert theirs[n].lora_A.weight.requires_grad and theirs[n].lora_B.weight.requires_grad
    assert torch.equal(logits(fresh.model), logits(pol.model))
    assert (fresh.lora_rank, fresh.lora_alpha) == (8, 32)


@pytest.mark.parametrize("rank", [0, 4])
def test_load_adds_lora_where_missing_or_of_another_rank(trained, base, rank):
    pol, ad = trained
    other = policy(base, rank=rank)
    load_adapter(other, ad)
    assert all(layer.r == 8 and layer.scaling == 4.0 for _, layer in quantized_layers(other.model))
    assert torch.equal(logits(other.model), logits(pol.model))


def test_rslora_round_trip_and_peft(base, tmp_path):
    pol = policy(base, "bf16", lora_alpha=16)
    randomize_lora(pol.model)
    for _, layer in quantized_layers(pol.model):
        layer.scaling = layer.lora_alpha / math.sqrt(layer.r)
    ad = save_adapter(pol, tmp_path / "rs")
    assert json.loads((ad / "adapter_config.json").read_text())["use_rslora"] is True
    fresh = policy(base, "bf16")
    load_adapter(fresh, ad)
    assert all(layer.scaling == 16 / math.sqrt(8) for _, layer in quantized_layers(fresh.model))
    assert torch.equal(logits(fresh.model), logits(pol.model))
    pm = peft_model(base, ad)
    torch.testing.assert_close(logits(pm), logits(pol.model), rtol=1e-5, atol=1e-5)


# ---- PEFT reads ours, we read PEFT's --------------------------------------------------------


def test_peft_loads_our_adapter_exactly(base, tmp_path):
    from peft.utils import get_peft_model_state_dict

    pol = policy(base, "bf16", lora_alpha=32)  # bf16 base in float32: the same weights as PEFT's dense base
    randomize_lora(pol.model)
    ad = save_adapter(pol, tmp_path / "adapter")
    pm = peft_model(base, ad)
    assert set(get_peft_model_state_dict(pm)) == set(load_file(ad / "adapter_model.safetensors"))
    for name, layer in quantized_layers(pol.model):
        theirs = pm.base_model.model.get_submodule(name)
        assert torch.equal(theirs.lora_A["default"].weight, layer.lora_A.weight), name
        assert torch.equal(theirs.lora_B["default"].weight, layer.lora_B.weight), name
        assert theirs.scaling["default"] == layer.scaling
        assert torch.equal(theirs.get_delta_weight("default"), layer.lora_delta()), name
    torch.testing.assert_close(logits(pm), logits(pol.model), rtol=1e-5, atol=1e-5)


def test_peft_logits_differ_only_by_the_quantization_error(base, tmp_path):
    pol = policy(base, "nvfp4")
    randomize_lora(pol.model)
    pm = peft_model(base, save_adapter(pol, tmp_path / "adapter"))
    dense, quant = policy(base, "bf16", rank=0), policy(base, "nvfp4", rank=0)
    x = ids()
    adapter_gap = (logits(pm, x) - logits(pol.model, x)).abs().mean()
    base_gap = (logits(dense.model, x) - logits(quant.model, x)).abs().mean()
    assert base_gap > 1e-4  # far above float32 noise (~1e-7 here): the comparison is not vacuous
    assert 0.5 < adapter_gap / base_gap < 2.0, (adapter_gap, base_gap)


def test_we_load_an_adapter_peft_wrote(base, tmp_path):
    from peft import LoraConfig, get_peft_model

    dense = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    pm = get_peft_model(dense, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                          task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    pm.save_pretrained(tmp_path / "theirs")
    pol = policy(base, "bf16", rank=0)
    load_adapter(pol, tmp_path / "theirs")
    with_lora = sorted(n.rsplit(".", 1)[-1] for n, layer in quantized_layers(pol.model) if layer.r)
    assert with_lora == sorted(["q_proj", "v_proj", "down_proj"] * 2)
    torch.testing.assert_close(logits(pol.model), logits(pm.eval()), rtol=1e-5, atol=1e-5)


# ---- bad inputs --------------------------------------------------------------------------


def _edit(ad, fn):
    path = ad / "adapter_model.safetensors"
    t = load_file(path)
    fn(t)
    save_file(t, str(path), metadata={"format": "pt"})


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_or_truncated_file(trained, base, damage):
    _, ad = trained
    path = ad / "adapter_model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\x13\x37" * 100 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors: not a readable safetensors file.*corrupt or truncated"):
        load_adapter(policy(base), ad)


def test_wrong_shape_names_the_tensor(trained, base):
    _, ad = trained
    _edit(ad, lambda t: t.__setitem__(f"{Q0}.lora_A.weight", t[f"{Q0}.lora_A.weight"][:, :-1].contiguous()))
    fresh = policy(base)
    before = logits(fresh.model)
    with pytest.raises(AdapterError, match=rf"adapter_model\.safetensors: tensor '{Q0}\.lora_A\.weight' has shape \[8, 63\].*expects \[8, 64\]"):
        load_adapter(fresh, ad)
    assert torch.equal(logits(fresh.model), before)  # nothing was changed


def test_rank_in_config_disagrees_with_the_tensors(trained, base):
    _, ad = trained
    cfg = json.loads((ad / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))
    with pytest.raises(AdapterError, match=r"lora_A\.weight' has shape \[8, .*r=4"):
        load_adapter(policy(base), ad)


def test_missing_tensor(trained, base):
    _, ad = trained
    _edit(ad, lambda t: t.pop(f"{Q0}.lora_B.weight"))
    with pytest.raises(AdapterError, match=rf"adapter_model\.safetensors: missing tensor '{Q0}\.lora_B\.weight'"):
        load_adapter(policy(base), ad)


def test_missing_layer(trained, base):
    _, ad = trained
    down = "base_model.model.model.layers.1.mlp.down_proj"
    _edit(ad, lambda t: [t.pop(f"{down}.lora_{x}.weight") for x in "AB"])
    with pytest.raises(AdapterError, match=rf"missing tensor {down}\.lora_A\.weight"):
        load_adapter(policy(base), ad)
    with pytest.warns(UserWarning, match="keep their current LoRA"):
        load_adapter(policy(base), ad, strict=False)


def test_unknown_module(trained, base):
    _, ad = trained
    ghost = Q0.replace("layers.0", "layers.7")
    _edit(ad, lambda t: t.update({f"{ghost}.lora_A.weight": torch.zeros(8, 64), f"{ghost}.lora_B.weight": torch.zeros(64, 8)}))
    with pytest.raises(AdapterError, match=r"tensor '.*layers\.7\.self_attn\.q_proj\.lora_[AB]\.weight': unknown module"):
        load_adapter(policy(base), ad)
    with pytest.warns(UserWarning, match="unknown module"):
        load_adapter(policy(base), ad, strict=False)


def test_pickled_adapter_is_refused(trained, base):
    _, ad = trained
    (ad / "adapter_model.safetensors").unlink()
    (ad / "adapter_model.bin").write_bytes(b"\x80\x04\x95 not unpickled")
    with pytest.raises(AdapterError, match=r"adapter_model\.bin: pickled adapters are not loaded"):
        load_adapter(policy(base), ad)


@pytest.mark.parametrize("edit, match", [
    ({"use_dora": True}, "DoRA"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all'"),
])  # fmt: skip
def test_unsupported_configs(trained, base, edit, match):
    _, ad = trained
    cfg = json.loads((ad / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(AdapterError, match=rf"adapter_config\.json: .*{match}"):
        load_adapter(policy(base), ad)


def test_missing_config(trained, base):
    _, ad = trained
    (ad / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter(policy(base), ad)
