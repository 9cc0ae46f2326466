"""modules_to_not_convert (transformers' name; llm-compressor's ignore patterns): chosen linears stay
in bf16, keep their LoRA adapter, and compute with the checkpoint's own weight."""

import pytest
import torch
from safetensors.torch import load_file

from qerl.model import load_policy
from qerl.rl import GRPOConfig
from tiny_models import save_tiny

KEEP = ["layers.1.mlp.down_proj", r"re:model\.layers\.0\.self_attn\.(q|k)_proj"]


def test_chosen_layers_stay_bf16_with_their_adapter_and_the_rest_is_quantized(tmp_path, recwarn):
    save_tiny(tmp_path, "llama")
    pol = load_policy(tmp_path, "nvfp4", lora_rank=4, dtype=torch.float32, progress=False, modules_to_not_convert=KEEP)
    assert not [w for w in recwarn if "bf16" in str(w.message)]  # a choice, not a fallback warning
    layers = pol.model.model.layers
    kept = {"model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"}
    sd = load_file(tmp_path / "model.safetensors")
    for name, m in pol.model.named_modules():
        if hasattr(m, "fmt") and hasattr(m, "lora_A"):
            assert m.fmt.name == ("bf16" if name in kept else "nvfp4"), name
            assert m.r == 4
    assert pol.bf16_fallback == []
    # a kept layer (adapter B = 0) computes x W^T with the checkpoint's weight, to fp32 rounding
    x = torch.randn(3, layers[1].mlp.down_proj.in_features)
    w = sd["model.layers.1.mlp.down_proj.weight"].float()
    with torch.no_grad():
        assert torch.allclose(layers[1].mlp.down_proj(x), x @ w.t(), atol=1e-5)
        q = layers[1].mlp.up_proj(torch.randn(3, layers[1].mlp.up_proj.in_features))
    assert torch.isfinite(q).all()


def test_a_pattern_that_names_nothing_is_refused(tmp_path):
    save_tiny(tmp_path, "llama")
    with pytest.raises(ValueError, match="modules_to_not_convert: 'layers.9.mlp.down_proj' matches no module"):
        load_policy(tmp_path, "nvfp4", lora_rank=4, progress=False, modules_to_not_convert=["layers.9.mlp.down_proj"])
    # transformers' usual entry names a module qerl never quantizes: accepted
    load_policy(tmp_path, "nvfp4", lora_rank=0, progress=False, modules_to_not_convert=["lm_head"])


def test_the_config_field_reaches_the_loaded_policy(tmp_path):
    save_tiny(tmp_path / "m", "llama")
    from tiny_models import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path / "m")
    cfg = GRPOConfig(model_name_or_path=str(tmp_path / "m"), modules_to_not_convert=["down_proj"], device="cpu",
                     output_dir=str(tmp_path / "run"), report_to="none", max_steps=1, num_generations=2,
                     per_device_train_batch_size=2, generation_batch_size=2)
    from qerl.rl import GRPOTrainer

    tr = GRPOTrainer(cfg, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                     train_dataset=[{"prompt": "1+1="}], progress=False)
    downs = [m.fmt.name for n, m in tr.model.named_modules() if n.endswith("mlp.down_proj")]
    assert downs and set(downs) == {"bf16"}


def _fmt_of(model, suffix):
    return {m.fmt.name for n, m in model.named_modules() if n.endswith(suffix) and hasattr(m, "fmt")}


def test_sft_keeps_the_layers_and_its_adapter_brings_them_back_in_bf16(tmp_path):
    """SFT loads with every loading option GRPO has (TrainParts.build); the adapter records the layers kept in
    bf16, and a load under it (the adapter-folder branch of load_policy: GRPO started from it) keeps them again."""
    import json

    from qerl.sft import SFTConfig, SFTTrainer
    from tiny_models import tiny_tokenizer

    base = tmp_path / "m"
    save_tiny(base, "llama")
    tiny_tokenizer().save_pretrained(base)
    rows = [{"prompt": f"add {i} {i + 3}", "completion": f" = {2 * i + 3}"} for i in range(4)]
    tr = SFTTrainer(SFTConfig(model_name_or_path=str(base), modules_to_not_convert=["down_proj"], lora_r=4,
                              max_steps=1, per_device_train_batch_size=4, output_dir=str(tmp_path / "sft"),
                              report_to="none", device="cpu", dtype="float32"), train_dataset=rows, progress=False)
    assert _fmt_of(tr.model, "mlp.down_proj") == {"bf16"} and _fmt_of(tr.model, "mlp.up_proj") == {"nvfp4"}
    tr.train()
    adapter = tmp_path / "sft" / "adapter"
    info = json.loads((adapter / "qerl_adapter.json").read_text())
    assert info["modules_to_not_convert"] == ["down_proj"] and info["base_quant"] == "nvfp4"
    again = load_policy(str(adapter), "nvfp4", device="cpu", dtype=torch.float32, progress=False)
    assert _fmt_of(again.model, "mlp.down_proj") == {"bf16"} and _fmt_of(again.model, "mlp.up_proj") == {"nvfp4"}
    assert again.modules_to_not_convert == ("down_proj",)
    # the trained factors of a kept layer are the adapter's, on the checkpoint's own bf16 weight
    want = dict(tr.model.named_parameters())
    for n, p in again.model.named_parameters():
        if "mlp.down_proj.lora_B" in n:
            assert torch.equal(p, want[n])
    # asked for explicitly, other layers win over the recorded ones
    other = load_policy(str(adapter), "nvfp4", device="cpu", dtype=torch.float32, progress=False,
                        modules_to_not_convert=["up_proj"])
    assert _fmt_of(other.model, "mlp.down_proj") == {"nvfp4"} and _fmt_of(other.model, "mlp.up_proj") == {"bf16"}
    # the CLI's loader (qerl export / eval: base + adapter) keeps them too, so a merge starts from bf16
    from qerl.cli.policy import load_cli_policy

    cli_pol, _ = load_cli_policy(str(base), "nvfp4", str(adapter), "cpu")
    assert _fmt_of(cli_pol.model, "mlp.down_proj") == {"bf16"} and _fmt_of(cli_pol.model, "mlp.up_proj") == {"nvfp4"}
