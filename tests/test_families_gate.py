"""The architecture gate checks what is built, and what the engine cannot run is refused, never run wrong."""

import json

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM

from qerl.model import load_policy
from qerl.model.family import UnsupportedModelError, family_of_config
from qerl.train.packing import has_sliding_window
from qerl.rollout import Engine, SamplingParams
from qerl.rollout.forward import ModelView, extend, prefill
from qerl.rollout.kv_cache import KVCache
from test_families import IDS, SIZES, family_config, hf_greedy, save_family


def _tiny(cfg):
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.08)
    return m


def _granite():
    return tf.GraniteConfig(num_hidden_layers=2, embedding_multiplier=4.0, residual_multiplier=0.5,
                            attention_multiplier=0.1, logits_scaling=2.0, **SIZES, **IDS)


def test_llama_label_on_a_granite_config_is_refused(tmp_path):
    """transformers builds model_type granite as Granite whatever the label says; qerl used to read the label
    alone, load it and sample Llama's arithmetic on Granite's weights."""
    _tiny(_granite()).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="model_type 'granite'"):
        load_policy(tmp_path, progress=False)


def test_a_label_that_disagrees_with_a_supported_model_type_is_refused(tmp_path):
    save_family(tmp_path, "gemma3")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="Gemma3ForCausalLM.*disagree"):
        load_policy(tmp_path, progress=False)


@pytest.mark.parametrize("cfg", [
    _granite(),
    tf.Gemma2Config(num_hidden_layers=2, head_dim=16, **SIZES, **IDS),
], ids=["granite", "gemma2"])
def test_engine_refuses_a_model_it_does_not_know(cfg):
    m = _tiny(cfg)
    with pytest.raises(UnsupportedModelError, match=type(m).__name__):
        Engine(m, max_len=64, max_slots=2)


def test_engine_refuses_a_foreign_layer_inside_a_known_model():
    m = _tiny(family_config("llama"))
    g2 = tf.Gemma2Config(num_hidden_layers=2, head_dim=16, **SIZES, **IDS)
    m.model.layers[1] = tf.models.gemma2.modeling_gemma2.Gemma2DecoderLayer(g2, 1)
    with pytest.raises(UnsupportedModelError, match="model.layers.1 is a Gemma2DecoderLayer"):
        Engine(m, max_len=64, max_slots=2)


def test_multimodal_gemma3_config_is_refused():
    with pytest.raises(UnsupportedModelError, match="gemma3"):
        family_of_config(tf.Gemma3Config(), "x")


@pytest.mark.parametrize("family, sliding", [("llama", False), ("qwen3", False), ("mistral", True), ("gemma3", True),
                                             ("phi3", True), ("olmo3", True), ("olmo2", False)])
def test_packed_rows_are_not_built_for_sliding_layers(family, sliding):
    """The packed update's mask has no windows: a model with sliding layers trains unpacked, where transformers
    builds each layer's window mask. transformers' has_sliding_layers misses Mistral's window on every layer."""
    assert has_sliding_window(_tiny(family_config(family))) is sliding


def test_fused_decode_attention_refuses_windows():
    m = _tiny(family_config("mistral"))
    eng = Engine(m, max_len=64, max_slots=2, fused_attention=True)
    with pytest.raises(UnsupportedModelError, match="fused decode attention"):
        eng.generate([[3, 4, 5]], params=SamplingParams(max_new_tokens=4, greedy=True))


@pytest.mark.parametrize("family", ["mistral", "gemma3", "phi3"])
def test_extend_past_the_window_equals_hf_forward(family):
    """The multi-turn path (tool output appended to a cached prefix) masks the same windows."""
    m = _tiny(family_config(family))
    view = ModelView(m)
    cache = KVCache(view, 2, 64)
    rope = view.rope_tables(64)
    first, more = list(range(10, 22)), list(range(30, 41))
    with torch.no_grad():
        prefill(view, cache, torch.tensor([first]), torch.tensor([len(first)]), [[1]], rope)
        got = extend(view, cache, [1], [torch.tensor(more)], [len(first)], rope)[0]
        want = m(torch.tensor([first + more])).logits[0, -1].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _longrope_phi3():
    half = 8  # rotary dims / 2 (head_dim 16)
    return tf.Phi3Config(num_hidden_layers=2, original_max_position_embeddings=64,
                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                          "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                          "long_factor": [2.0 + 0.5 * i for i in range(half)],
                                          "original_max_position_embeddings": 64},
                         **{**SIZES, "max_position_embeddings": 256}, **IDS)


def test_longrope_within_its_original_length_equals_hf_and_past_it_is_refused():
    m = _tiny(_longrope_phi3())
    with pytest.raises(UnsupportedModelError, match="longrope"):
        Engine(m, max_len=128, max_slots=2)
    eng = Engine(m, max_len=64, max_slots=2)
    prompt = list(range(20, 40))
    (c,) = eng.generate([prompt], params=SamplingParams(max_new_tokens=24, greedy=True, ignore_eos=True))
    assert c.token_ids == hf_greedy(m, prompt, 24)
