"""`qerl export` of a run trained with lm_head_4bit / embed_4bit: the merged model holds the 4-bit head's and
the 4-bit embedding's dequantized values the policy trained with (recorded beside the adapter in
qerl_adapter.json, else read from the run's config.yaml), so transformers' AutoModelForCausalLM gives the
trained policy's logits, wherever the adapter folder was copied; a run without them exports as before."""

import json
import re
import shutil

import pytest
import torch
from cli_runs import sft_args, train_args
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from qerl.checkpoint.checksums import write_checksums
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


# ---- the options travel with the adapter folder (qerl_adapter.json) ----------------------------------------


def export(cli, adapter, out):
    """`qerl export OUT --adapter ADAPTER --dtype float32`: (stdout, the merged model's tensors)."""
    rc, text, err = cli("export", out, "--adapter", adapter, "--dtype", "float32")
    assert rc == 0, err
    return text, load_file(out / "model.safetensors")


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("kind,dtype", [("train", "bfloat16"), ("sft", "float32")])
def test_the_adapter_records_the_options_and_the_dtype_they_were_quantized_from(runs, kind, dtype):
    for adapter in (runs[kind] / "adapter", runs[kind] / "checkpoint-1" / "adapter"):
        info = json.loads((adapter / "qerl_adapter.json").read_text())
        assert (info["lm_head_4bit"], info["embed_4bit"], info["compute_dtype"]) == (True, True, dtype), info
    plain = json.loads((runs["plain"] / "adapter" / "qerl_adapter.json").read_text())
    assert not {"lm_head_4bit", "embed_4bit", "compute_dtype"} & plain.keys(), plain


@pytest.mark.parametrize("kind", ["train", "sft"])
def test_an_adapter_copied_out_of_its_run_exports_the_same_model(cli, model, runs, tmp_path, kind):
    run = runs[kind]
    text, here = export(cli, run / "adapter", tmp_path / "in_place")
    assert "lm_head_4bit and embed_4bit" in text and str(run / "config.yaml") in text, text
    copy = shutil.copytree(run / "adapter", tmp_path / "elsewhere" / "adapter")  # no run around it: no config.yaml
    text, there = export(cli, copy, tmp_path / "copied")
    assert "lm_head_4bit and embed_4bit" in text and str(copy / "qerl_adapter.json") in text, text
    assert "config.yaml" not in text and "disagree" not in text, text
    assert same_tensors(here, there)  # the same head and embedding bytes, and every other tensor
    base = load_file(model / "model.safetensors")
    for k in ("lm_head.weight", "model.embed_tokens.weight"):  # the 4-bit values, not the base's dense ones
        assert not torch.equal(there[k], base[k].float()), k


def _strip_record(adapter):
    """qerl_adapter.json as qerl wrote it before it recorded the options (its checksums.json to match)."""
    path = adapter / "qerl_adapter.json"
    info = json.loads(path.read_text())
    old = {k: v for k, v in info.items() if k not in ("lm_head_4bit", "embed_4bit", "compute_dtype")}
    assert old != info and old.get("base_quant")
    path.write_text(json.dumps(old) + "\n")
    if (adapter / "checksums.json").is_file():
        write_checksums(adapter)


def test_an_old_record_without_the_options_exports_as_before(cli, model, runs, tmp_path):
    """In its run: the options from config.yaml, as before; copied out of it: none (what export always did)."""
    _, want = export(cli, runs["train"] / "adapter", tmp_path / "want")
    run = shutil.copytree(runs["train"], tmp_path / "old_run")
    _strip_record(run / "adapter")
    text, got = export(cli, run / "adapter", tmp_path / "in_place")
    assert "lm_head_4bit and embed_4bit" in text and str(run / "config.yaml") in text, text
    assert "qerl_adapter.json" not in text, text
    assert same_tensors(got, want)
    copy = shutil.copytree(run / "adapter", tmp_path / "elsewhere" / "adapter")
    text, alone = export(cli, copy, tmp_path / "copied")
    assert "4bit" not in text, text
    base = load_file(model / "model.safetensors")
    for k in ("lm_head.weight", "model.embed_tokens.weight"):  # nothing says 4 bits: the base's dense tensors
        assert torch.equal(alone[k], base[k].float()), k


def test_when_the_record_and_the_runs_config_disagree_one_line_says_so_and_the_adapters_wins(cli, runs, tmp_path):
    _, want = export(cli, runs["train"] / "adapter", tmp_path / "want")
    run = shutil.copytree(runs["train"], tmp_path / "edited_run")
    cfg = run / "config.yaml"
    text, n = re.subn(r"(?m)^embed_4bit: true$", "embed_4bit: false", cfg.read_text())
    assert n == 1
    cfg.write_text(text)
    text, got = export(cli, run / "adapter", tmp_path / "merged")
    lines = [x for x in text.splitlines() if "disagree" in x]
    assert len(lines) == 1 and "embed_4bit True (there: False)" in lines[0] and str(cfg) in lines[0], text
    assert "lm_head_4bit and embed_4bit" in text, text
    assert same_tensors(got, want)


@pytest.mark.parametrize("kind", ["train", "sft"])
def test_eval_and_generate_load_the_4bit_head_and_embedding_the_adapter_trained_with(model, runs, kind):
    """cli/policy.load_cli_policy (qerl eval, qerl generate) on the adapter alone: the trained policy's head and
    embedding values, and the engine decodes with them (fp32 on the CPU; the GRPO run trained in bf16)."""
    from qerl.cli.policy import load_cli_policy
    from qerl.rollout import Engine, SamplingParams

    pol, _ = load_cli_policy(str(model), "auto", str(runs[kind] / "adapter"), "cpu")
    trained = trained_policy(runs[kind])
    head, emb = pol.model.lm_head, pol.model.get_input_embeddings()
    assert isinstance(head, QuantHead) and isinstance(emb, QuantEmbedding)
    assert torch.equal(head.layer.dequantized_weight(torch.float32),
                       trained.model.lm_head.layer.dequantized_weight(torch.float32))
    t_emb = trained.model.get_input_embeddings()  # (its rows rounded to the dtype it trained in)
    assert torch.equal(emb.weight.to(t_emb.dtype), t_emb.weight)
    ref, got = logits(trained.model), logits(pol.model)
    tol = 1e-4 if trained.model.dtype == torch.float32 else 0.02
    torch.testing.assert_close(got, ref, rtol=0, atol=tol * ref.abs().max())
    p = SamplingParams(max_new_tokens=4, greedy=True, ignore_eos=True)
    out = Engine(pol.model, max_len=64, max_slots=2).generate([[5, 6, 7]], n=1, params=p)
    assert len(out[0].token_ids) == 4
