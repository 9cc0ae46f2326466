"""The family spec (model/family.py, model/families/) is the one source of a family's facts: the norm
class the decode glue and AQN treat as Llama-form, the experts' checkpoint format and config fields the
random builder and the step planner read. Checked against what transformers builds."""

import sys

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM

from qerl.model import moe_config
from qerl.model.families import FAMILIES
from qerl.model.family import family_of_config, llama_norm_classes
from test_families import FAMILIES as DENSE
from test_families import IDS, SIZES, family_config

MOE = {"qwen3_moe": lambda: moe_config("qwen3-moe-tiny"), "gpt_oss": lambda: moe_config("gpt-oss-tiny"),
       "mixtral": lambda: tf.MixtralConfig(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                           **SIZES, **IDS)}


def _config(name):
    return MOE[name]() if name in MOE else family_config(name)


def test_every_family_is_checked_here():
    assert {f.name for f in FAMILIES} == set(DENSE) | set(MOE)


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_the_norm_class_and_the_experts_fields_are_what_transformers_builds(name):
    cfg = _config(name)
    fam = family_of_config(cfg, name)
    assert fam.name == name
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    layer = model.model.layers[0]
    norm = getattr(layer, fam.norms.attn_in or fam.norms.attn_out)
    assert type(norm).__name__ == fam.norm_class
    if fam.experts is not None:
        experts = layer.get_submodule(fam.experts.path)
        assert experts.gate_up_proj.shape[0] == getattr(cfg, fam.experts.count)
        assert getattr(cfg, fam.experts.intermediate) in experts.down_proj.shape  # [E, H, I], or transposed
        assert (getattr(experts, "gate_up_proj_bias", None) is not None) == fam.experts.bias


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_the_norm_form_restates_the_norm_transformers_builds(name):
    """Each family's norm_form is its RMSNorm's arithmetic: the engine's restatement (the Llama glue, or
    AQN's noisy_norm at zero noise) gives the transformers module's output bit for bit, and the other
    forms do not (so a wrong norm_form fails here, not as a silently different rollout)."""
    from qerl.rollout.forward import noisy_norm, rms_norm

    cfg = _config(name)
    fam = family_of_config(cfg, name)
    cls = getattr(sys.modules[getattr(tf, fam.causal_lm).__module__], fam.norm_class)  # its modeling module's
    norm = cls(256, eps=1e-6).to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(256, generator=g))
    x = (3 * torch.randn(64, 256, generator=g)).to(torch.bfloat16)
    zero = torch.zeros(256)
    forms = {"llama": lambda: rms_norm(x, norm.weight, 1e-6, zero),
             "offset": lambda: noisy_norm(x, norm.weight, 1e-6, zero, "offset"),
             "fp32": lambda: noisy_norm(x, norm.weight, 1e-6, zero, "fp32")}
    want = norm(x)
    matches = {f for f, run in forms.items() if torch.equal(run(), want)}
    assert matches == {fam.norm_form}, (name, matches)
    assert (type(norm).__name__ in llama_norm_classes()) == (fam.norm_form == "llama")


def test_the_random_builder_keeps_the_checkpoint_format_of_the_experts():
    from qerl.layers.quant_experts import QuantExperts
    from qerl.model import random_policy

    for name, want in (("gpt-oss-tiny", "mxfp4"), ("qwen3-moe-tiny", "nvfp4")):
        pol = random_policy(moe_config(name), "nvfp4", lora_rank=0, device="cpu", dtype=torch.bfloat16,
                            progress=False)
        assert {m.fmt.name for m in pol.model.modules() if isinstance(m, QuantExperts)} == {want}
