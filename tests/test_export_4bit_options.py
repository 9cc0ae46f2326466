"""`qerl export` of a run trained with lm_head_4bit / embed_4bit: the merged model holds the 4-bit head's and
the 4-bit embedding's dequantized values the policy trained with (read from the run's config.yaml), so
transformers' AutoModelForCausalLM gives the trained policy's logits; a run without them exports as before."""

import pytest
import torch
from cli_runs import sft_args, train_args
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qerl.checkpoint.peft_adapter import load_adapter
from qerl.cli import main
from qerl.layers.quant_embed import QuantEmbedding
from qerl.layers.quant_head import QuantHead
from qerl.model import load_policy
from qerl.train.fields import yaml_mapping
from qerl.train.parts import load_configured_policy, resolve_device_dtype

FOUR_BIT = ("--lm_head_4bit", "true", "--embed_4bit", "true")


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """One step of each command on the tiny model: GRPO (its config records dtype bfloat16; no update, the
    adapter stays as initialised) and SFT (dtype auto: fp32 on the CPU; its LoRA trained), with both options,
    and a GRPO run without them."""
    root = tmp_path_factory.mktemp("runs")
    made = {"train": train_args(model, root / "train", "--max_steps", "1", *FOUR_BIT),
            "sft": sft_args(model, root / "sft", *FOUR_BIT),
            "plain": train_args(model, root / "plain", "--max_steps", "1")}
    for args in made.values():
        assert main([str(a) for a in args]) == 0
    return {k: root / k for k in made}


def trained_policy(run):
    """The policy as training built it: load_configured_policy with the run's config, then its adapter."""
    from qerl.cli.run_config import run_kind
    from qerl.rl import GRPOConfig
    from qerl.sft.config import SFTConfig

    cfg = {"train": GRPOConfig, "sft": SFTConfig}[run_kind(run)].from_yaml(run / "config.yaml")
    device, dtype = resolve_device_dtype(cfg)
    pol = load_configured_policy(cfg, device, dtype, progress=False)
    load_adapter(pol, run / "adapter")
    return pol


def logits(model):
    x = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(x).logits.float()


@pytest.mark.parametrize("kind", ["train", "sft"])
def test_export_of_a_4bit_run_computes_what_the_trained_policy_computed(cli, model, runs, tmp_path, kind):
    run = runs[kind]
    rc, out, err = cli("export", tmp_path / "merged", "--adapter", run / "adapter", "--dtype", "float32")
    assert rc == 0, err
    assert "lm_head_4bit and embed_4bit" in out and str(run / "config.yaml") in out, out
    dense, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    pol = trained_policy(run)
    head, emb = pol.model.lm_head, pol.model.get_input_embeddings()
    assert isinstance(head, QuantHead) and isinstance(emb, QuantEmbedding)
    # the same 4-bit bytes: the export's head and table are the policy's dequantized ones, exactly
    assert torch.equal(dense.lm_head.weight, head.layer.dequantized_weight(torch.float32))
    assert torch.equal(dense.model.embed_tokens.weight, emb.weight.float())
    base = load_file(model / "model.safetensors")
    assert not torch.equal(dense.lm_head.weight, base["lm_head.weight"].float())
    assert not torch.equal(dense.model.embed_tokens.weight, base["model.embed_tokens.weight"].float())

    ref = logits(pol.model)
    got = logits(dense)
    tol = 1e-4 if pol.model.dtype == torch.float32 else 0.02
    torch.testing.assert_close(got, ref, rtol=0, atol=tol * ref.abs().max())
    # the policy without the options (what export wrote before) is far off by comparison
    plain = load_policy(str(model), "nvfp4", lora_rank=0, dtype=torch.float32, progress=False)
    load_adapter(plain, run / "adapter")
    assert (logits(plain.model) - ref).abs().max() > 5 * (got - ref).abs().max()


def test_a_checkpoints_adapter_is_exported_with_its_runs_options(cli, runs, tmp_path):
    """RUN/checkpoint-N/adapter: the options are the run's (RUN/config.yaml) as for RUN/adapter."""
    run = runs["train"]
    for name, adapter in (("final", run / "adapter"), ("ckpt", run / "checkpoint-1" / "adapter")):
        rc, out, err = cli("export", tmp_path / name, "--adapter", adapter, "--dtype", "float32")
        assert rc == 0 and "lm_head_4bit and embed_4bit" in out, err
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("final", "ckpt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_without_the_options_exports_as_before(cli, model, runs, tmp_path):
    run = runs["plain"]
    cfg = yaml_mapping(run / "config.yaml")
    assert cfg["lm_head_4bit"] is False and cfg["embed_4bit"] is False
    rc, out, err = cli("export", tmp_path / "merged", "--adapter", run / "adapter", "--dtype", "float32")
    assert rc == 0 and "4bit" not in out, (out, err)
    sd = load_file(tmp_path / "merged" / "model.safetensors")
    base = load_file(model / "model.safetensors")
    for k in ("lm_head.weight", "model.embed_tokens.weight"):  # the base's dense head and table, untouched
        assert torch.equal(sd[k], base[k].float()), k
