"""Model folders that transformers reads without a word but that fail in the first forward (or run a template
the sandbox refuses): each is one error naming the file and the tensor or field, before any forward. Shapes
are checked against the config's own skeleton (transformers builds it), not against numbers restated here."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_runs import one_line, train_args
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny, tiny_tokenizer

from qerl.checkpoint.compressed_tensors import save_compressed
from qerl.model import load_policy

O_PROJ = "model.layers.0.self_attn.o_proj"


def _load(folder, quant="nvfp4"):
    return load_policy(str(folder), quant, lora_rank=2, dtype=torch.float32, progress=False)


def _rewrite(folder, edit) -> None:
    sd = load_file(folder / "model.safetensors")
    edit(sd)
    save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama") / "m"
    save_tiny(d, "llama")
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def compressed(llama, tmp_path_factory):
    pol = load_policy(str(llama), "nvfp4", lora_rank=0, dtype=torch.float32, progress=False)
    return save_compressed(pol, tmp_path_factory.mktemp("ct") / "ct")


# ---- a projection stored in the wrong shape -------------------------------------------------------------------
@pytest.mark.parametrize("quant", ["nvfp4", "bf16"])
def test_an_o_proj_of_the_wrong_shape_is_named_at_load(llama, tmp_path, quant):
    bad = tmp_path / "m"
    shutil.copytree(llama, bad)
    want = list(load_file(llama / "model.safetensors")[f"{O_PROJ}.weight"].shape)
    _rewrite(bad, lambda sd: sd.update({f"{O_PROJ}.weight": sd[f"{O_PROJ}.weight"][:48]}))
    with pytest.raises(ValueError) as e:
        _load(bad, quant)
    msg = str(e.value)
    assert f"{bad / 'model.safetensors'}: tensor '{O_PROJ}.weight' has shape [48, {want[1]}]" in msg
    assert f"the config gives {want}" in msg


def test_a_packed_o_proj_of_the_wrong_shape_is_named_at_load(compressed, tmp_path):
    bad = tmp_path / "ct"
    shutil.copytree(compressed, bad)
    want = list(load_file(compressed / "model.safetensors")[f"{O_PROJ}.weight_packed"].shape)

    def cut(sd):
        for k in ("weight_packed", "weight_scale"):
            sd[f"{O_PROJ}.{k}"] = sd[f"{O_PROJ}.{k}"][:48]
    _rewrite(bad, cut)
    with pytest.raises(ValueError, match=rf"tensor '{O_PROJ}.weight_packed' holds a weight of \[48, {2 * want[1]}\]"):
        _load(bad, "auto")
    assert _load(compressed, "auto").quant == "nvfp4"  # the intact folder loads: the check is not the refusal


def test_the_command_line_names_the_tensor_before_training(cli, llama, tmp_path):
    bad = tmp_path / "m"
    shutil.copytree(llama, bad)
    _rewrite(bad, lambda sd: sd.update({f"{O_PROJ}.weight": sd[f"{O_PROJ}.weight"][:48]}))
    rc, _, err = cli(*train_args(bad, tmp_path / "run"))
    assert rc == 2 and f"'{O_PROJ}.weight' has shape [48, " in err.strip().splitlines()[-1], err
    assert not (tmp_path / "run" / "checkpoint-1").exists()


# ---- MoE ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from test_moe_experts import tiny_moe

    d = tmp_path_factory.mktemp("moe") / "m"
    tiny_moe("qwen3_moe").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_more_experts_per_token_than_experts_is_named(moe, tmp_path):
    from transformers import AutoConfig

    bad = tmp_path / "m"
    shutil.copytree(moe, bad)
    n = AutoConfig.from_pretrained(moe).num_experts
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": n + 1}))
    with pytest.raises(ValueError, match=rf"{bad / 'config.json'}: num_experts_per_tok is {n + 1}, but the model "
                                         rf"has {n} experts"):
        _load(bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": n}))
    _load(bad)  # all of them is a valid top-k


@pytest.fixture(scope="module")
def compressed_moe(moe, tmp_path_factory):
    pol = load_policy(str(moe), "nvfp4", lora_rank=0, dtype=torch.float32, progress=False)
    return save_compressed(pol, tmp_path_factory.mktemp("mct") / "ct")


def _expert_scales_in_fp32(folder, nudge: str | None = None):
    def edit(sd):
        for k in [k for k in sd if ".experts." in k and k.endswith(".weight_scale")]:
            sd[k] = sd[k].float()
        if nudge:
            sd[nudge][0, 0] = sd[nudge][0, 0] * 1.01  # between two FP8-E4M3 values
    _rewrite(folder, edit)


def test_an_expert_weight_scale_in_fp32_loads_as_the_same_fp8_values(compressed_moe, tmp_path):
    f32 = tmp_path / "ct"
    shutil.copytree(compressed_moe, f32)
    _expert_scales_in_fp32(f32)
    a, b = _load(compressed_moe, "auto").model, _load(f32, "auto").model
    scales = [n for n, t in b.named_buffers() if "scale" in n and ".experts" in n]
    assert scales and all(b.get_buffer(n).dtype == a.get_buffer(n).dtype for n in scales)
    ids = torch.randint(3, 150, (2, 8))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_an_expert_weight_scale_in_fp32_off_the_fp8_grid_is_refused_by_name(compressed_moe, tmp_path):
    bad = tmp_path / "ct"
    shutil.copytree(compressed_moe, bad)
    name = "model.layers.0.mlp.experts.1.down_proj.weight_scale"
    _expert_scales_in_fp32(bad, nudge=name)
    with pytest.raises(ValueError, match=rf"tensor '{name}' is torch.float32, expected torch.float8_e4m3fn"):
        _load(bad, "auto")


# ---- a chat template the sandbox refuses --------------------------------------------------------------------
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_a_chat_template_the_sandbox_refuses_names_its_file(llama, tmp_path, where):
    bad = tmp_path / "m"
    shutil.copytree(llama, bad)
    (bad / "chat_template.jinja").unlink(missing_ok=True)
    if where == "chat_template.jinja":
        (bad / where).write_text(ESCAPE)
        named = f"{bad / where}: "
    else:
        tc = json.loads((bad / where).read_text())
        (bad / where).write_text(json.dumps({**tc, "chat_template": ESCAPE}))
        named = f"{bad / where}: chat_template: "
    with pytest.raises(ValueError) as e:
        _load(bad)
    assert str(e.value).startswith(named) and "Jinja sandbox refuses" in str(e.value) and "\n" not in str(e.value)


def test_a_chat_template_that_does_not_parse_names_its_file(llama, tmp_path):
    bad = tmp_path / "m"
    shutil.copytree(llama, bad)
    (bad / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ValueError, match=rf"{bad / 'chat_template.jinja'}: the chat template is not valid Jinja"):
        _load(bad)
