"""Every family of model/families/ on tiny random models, against Hugging Face's own modules.

For each: the policy is really 4-bit (every projection NVFP4, norms untouched), and the engine's
greedy tokens equal HF `generate` on the very modules it runs and on the merged export, with
prompts and completions longer than the sliding windows (8) where the family has them.
"""

import copy

import pytest
import torch
import transformers as tf
from transformers import AutoModelForCausalLM

from qerl.checkpoint.export import export_merged
from qerl.layers import QLoRALinear
from qerl.model import load_policy
from qerl.model.family import UnsupportedModelError, family_of_config, family_of_model
from qerl.rollout import Engine, SamplingParams

SIZES = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)
WINDOW = 8
PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 32)), list(range(40, 65)), [3]]
NEW = 24


def family_config(family: str):
    """A tiny config of each family, with its distinctive features switched on."""
    if family == "llama":
        return tf.LlamaConfig(num_hidden_layers=2, **SIZES, **IDS)
    if family == "qwen2":  # sliding layers from max_window_layers on
        return tf.Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                              **SIZES, **IDS)
    if family == "qwen3":
        return tf.Qwen3Config(num_hidden_layers=2, head_dim=16, **SIZES, **IDS)
    if family == "mistral":
        return tf.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **SIZES, **IDS)
    if family == "gemma3":  # local (sliding, base 1e4) and global (1e6) layers, a capped lm_head
        return tf.Gemma3TextConfig(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                   layer_types=["sliding_attention", "full_attention"] * 2,
                                   final_logit_softcapping=30.0, **SIZES, **IDS)
    if family == "phi3":  # fused qkv/gate_up, partial rotary, a window on every layer
        return tf.Phi3Config(num_hidden_layers=2, sliding_window=WINDOW, partial_rotary_factor=0.5, **SIZES, **IDS)
    if family == "olmo2":
        return tf.Olmo2Config(num_hidden_layers=2, **SIZES, **IDS)
    if family == "olmo3":
        return tf.Olmo3Config(num_hidden_layers=4, sliding_window=WINDOW, **SIZES, **IDS)
    raise ValueError(family)


FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "olmo2", "olmo3"]
WINDOWED = ["qwen2", "mistral", "gemma3", "phi3", "olmo3"]


def save_family(path, family, seed=0):
    torch.manual_seed(seed)
    cfg = family_config(family)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_greedy(m, prompt, k=NEW):
    gc = copy.deepcopy(m.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = [], 0, False
    out = m.generate(torch.tensor([prompt]), generation_config=gc, max_new_tokens=k)
    return out[0, len(prompt):].tolist()


def engine_greedy(model):
    eng = Engine(model, max_len=128, max_slots=3, sync_every=4)
    outs = eng.generate(PROMPTS, n=1, params=SamplingParams(max_new_tokens=NEW, greedy=True, ignore_eos=True))
    return [c.token_ids for c in outs]


@pytest.fixture(scope="module", params=FAMILIES)
def loaded(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    ref = save_family(root / "base", family)
    pol = load_policy(str(root / "base"), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in pol.model.named_parameters():
            if "lora_B" in n:  # a live adapter: its expand runs and the export merges it
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return family, root, ref, pol


def test_policy_is_really_4bit(loaded):
    family, _, ref, pol = loaded
    fam = family_of_model(pol.model)
    assert fam.name == family
    ref_sd = ref.state_dict()
    for i in range(pol.config.num_hidden_layers):
        for t in fam.projections:
            layer = pol.model.get_submodule(fam.module(i, t))
            assert isinstance(layer, QLoRALinear) and layer.fmt.name == "nvfp4", fam.module(i, t)
    norms = [n for n in ref_sd if "norm" in n]
    assert norms
    for n in norms:  # norms (and q/k norms) untouched, in the model's dtype
        assert torch.equal(pol.model.state_dict()[n], ref_sd[n]), n


def test_engine_greedy_equals_hf_generate_on_the_same_modules(loaded):
    _, _, _, pol = loaded
    got = engine_greedy(pol.model)
    for p, toks in zip(PROMPTS, got):
        assert toks == hf_greedy(pol.model, p), p


def test_engine_greedy_equals_hf_generate_on_the_merged_export(loaded):
    family, root, _, pol = loaded
    export_merged(pol, root / "merged", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(root / "merged", dtype=torch.float32).eval()
    assert type(merged).__name__ == family_of_model(pol.model).causal_lm
    got = engine_greedy(pol.model)
    want = [hf_greedy(merged, p) for p in PROMPTS]
    assert got == want
    if family in WINDOWED:  # the windows matter here: with a window longer than the text HF's tokens differ
        cfg = copy.deepcopy(merged.config)
        cfg.sliding_window = 10**6
        full = AutoModelForCausalLM.from_pretrained(root / "merged", config=cfg, dtype=torch.float32).eval()
        assert [hf_greedy(full, p) for p in PROMPTS] != want
