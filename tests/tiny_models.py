"""Small random-weight models of the supported families, saved as real HF folders."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)


def config(family: str, **kw):
    kw = {**COMMON, **kw}
    if family == "llama":
        return LlamaConfig(architectures=["LlamaForCausalLM"], **kw)
    if family == "qwen2":
        return Qwen2Config(architectures=["Qwen2ForCausalLM"], **kw)
    if family == "qwen3":
        return Qwen3Config(architectures=["Qwen3ForCausalLM"], head_dim=16, **kw)
    raise ValueError(family)


def save_tiny(path, family="llama", seed=0, dtype=torch.bfloat16, **kw):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family, **kw)).to(dtype)
    with torch.no_grad():  # spread the weights so layers differ and quantization is non-trivial
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_tokenizer(vocab_size: int = 160):
    """A character-level fast tokenizer with a chat template and an EOS, for models of COMMON's vocab."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in chars:
        vocab[ch] = len(vocab)
    assert len(vocab) <= vocab_size
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    from tokenizers import decoders

    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    return tok
