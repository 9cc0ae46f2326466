"""The MoE step planner (bench/step_plan.py): its parameter counts against transformers' own models built
(on the meta device) from the real configs, its quantized bytes against what the loader allocates for
tiny models, and the issue's targets (a projection until a device measures it)."""

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM

from qerl.bench.step_plan import MOE_SHAPES, TARGETS_GIB, MoEShape, StepSettings, parameter_counts, plan_step
from qerl.layers import QLoRALinear
from qerl.layers.quant_experts import QuantExperts
from qerl.model import load_policy

REAL = {
    "qwen3-30b-a3b": lambda: tf.Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                               head_dim=128, num_experts=128, num_experts_per_tok=8,
                                               moe_intermediate_size=768, tie_word_embeddings=False),
    "gpt-oss-20b": lambda: tf.GptOssConfig(num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": lambda: tf.GptOssConfig(num_hidden_layers=36, num_local_experts=128),
}


def _counts(model):
    out = {"attention": 0, "experts": 0, "dense": 0}
    for n, p in model.named_parameters():
        kind = ("attention" if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
                else "experts" if n.endswith(("experts.gate_up_proj", "experts.down_proj")) else "dense")
        out[kind] += p.numel()
    return out


@pytest.mark.parametrize("name", list(REAL))
def test_parameter_counts_equal_transformers_models(name):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(REAL[name]())
    assert parameter_counts(MOE_SHAPES[name]) == _counts(model)


def test_quantized_bytes_equal_what_the_loader_allocates(tmp_path):
    from test_gpt_oss import write_stock_mxfp4
    from test_moe_experts import tiny_moe

    tiny_moe("qwen3_moe").save_pretrained(tmp_path / "qwen3_moe")
    write_stock_mxfp4(tmp_path / "gpt_oss")
    shapes = {"qwen3_moe": MoEShape("qwen3-tiny", 64, 2, 4, 2, 16, 160, 8, 2, 32, "nvfp4", qk_norm=True),
              "gpt_oss": MoEShape("gpt-oss-tiny", 64, 2, 4, 2, 16, 160, 4, 2, 64, "mxfp4", True, True, sinks=True)}
    for folder, shape in shapes.items():
        pol = load_policy(str(tmp_path / folder), "nvfp4", lora_rank=0, dtype=torch.bfloat16, progress=False)
        experts = sum(b.numel() * b.element_size() for m in pol.model.modules() if isinstance(m, QuantExperts)
                      for k, b in m.named_buffers() if not k.endswith("_bias"))
        attention = sum(t.numel() * t.element_size() for m in pol.model.modules() if isinstance(m, QLoRALinear)
                        for t in m.checkpoint_tensors().values())
        plan = plan_step(shape, StepSettings())
        assert (plan.experts, plan.attention) == (experts, attention), folder


@pytest.mark.parametrize("name", list(TARGETS_GIB))
def test_each_target_has_a_measured_step_within_it(name):
    """The recipe of each target is a step that ran: its record's peak reserved is within the target, and the
    settings its case names are a setting the model takes (read back from the case, as bench step wrote it)."""
    from pathlib import Path

    from qerl.bench import memory_fit as mf
    from qerl.bench.step_plan import FITS_RECORDS

    step = mf.select(mf.load_steps(Path(__file__).parents[1] / "benchmarks/results/step.jsonl"), FITS_RECORDS[name])
    assert step.peak_reserved is not None and step.peak_reserved <= TARGETS_GIB[name], step
    shape, st = mf.settings_of_case(step.case, step.commit)
    assert shape == MOE_SHAPES[name]
    g = plan_step(shape, st).gib()
    assert g["experts"] > 0.8 * g["weights"]  # an MoE's memory is its experts: where 4 bits pay
