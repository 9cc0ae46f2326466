"""Nothing the user keeps is replaced by mistake: `qerl export` and `qerl quantize` ask one guard (a run folder,
a folder holding one at any depth, the model or adapter they read, the current folder: refused even with
--overwrite; a folder holding anything: only with --overwrite), refused before loading; `save_total_limit`
below 1 is refused; the adapter records its base's format and a base_model_name_or_path PEFT can resolve."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, base):
    """A run folder (as `qerl train` leaves it) whose adapter was trained on an NVFP4 base."""
    from qerl.checkpoint import save_adapter
    from qerl.model import load_policy

    run = tmp_path_factory.mktemp("r") / "run"
    pol = load_policy(str(base), "nvfp4", lora_rank=4, device="cpu", dtype=torch.float32, progress=False)
    torch.manual_seed(0)
    for m in pol.model.modules():
        if hasattr(m, "lora_B") and m.r:
            torch.nn.init.normal_(m.lora_B.weight, std=0.02)
    save_adapter(pol, run / "adapter")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "checkpoint-1").mkdir()
    (run / "config.yaml").write_text("max_steps: 1\n")
    return run / "adapter"


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def test_export_into_a_folder_holding_files_is_refused_without_overwrite(cli, tmp_path, base, adapter, no_model_load):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc, _, err = cli("export", base, out, "--adapter", adapter)
    assert rc == 2 and "not empty" in err and "notes.txt" in err and "--overwrite" in err
    assert (out / "notes.txt").read_text() == "mine"


def test_export_with_overwrite_replaces_the_folder(cli, tmp_path, base, adapter):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc, _, err = cli("export", base, out, "--adapter", adapter, "--overwrite")
    assert rc == 0, err
    assert (out / "config.json").is_file() and not (out / "notes.txt").exists()


@pytest.mark.parametrize("where", ["run", "adapter", "base"])
def test_export_never_replaces_a_run_the_adapter_or_the_base(cli, base, adapter, where, no_model_load):
    out = {"run": adapter.parent, "adapter": adapter, "base": base}[where]
    before = _tree(out)
    rc, _, err = cli("export", base, out, "--adapter", adapter, "--overwrite")
    assert rc == 2 and "would delete it" in err, err
    assert _tree(out) == before


def test_export_into_a_file_is_refused(cli, tmp_path, base, adapter, no_model_load):
    f = tmp_path / "x"
    f.write_text("keep")
    rc, _, err = cli("export", base, f, "--adapter", adapter)
    assert rc == 2 and "is a file" in err and f.read_text() == "keep"


def test_export_with_another_quant_than_the_adapters_base_is_refused(cli, tmp_path, base, adapter, no_model_load):
    rc, _, err = cli("export", base, tmp_path / "out", "--adapter", adapter, "--quant", "nf4")
    assert rc == 2 and "trained on a nvfp4 base" in err and "--quant nvfp4" in err


def test_eval_with_another_quant_than_the_adapters_base_is_refused(cli, base, adapter, no_model_load):
    rc, _, err = cli("eval", base, "--adapter", adapter, "--quant", "mxfp4", "--limit", "1", "--max-new-tokens", "8")
    assert rc == 2 and "trained on a nvfp4 base" in err


def test_export_auto_quant_takes_the_adapters_base_format(cli, tmp_path, base, adapter):
    from safetensors.torch import load_file

    assert cli("export", base, tmp_path / "auto", "--adapter", adapter, "--dtype", "float32")[0] == 0
    assert cli("export", base, tmp_path / "nvfp4", "--adapter", adapter, "--dtype", "float32",
               "--quant", "nvfp4")[0] == 0
    assert cli("export", base, tmp_path / "nf4", "--dtype", "float32", "--quant", "nf4")[0] == 0
    a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("auto", "nvfp4"))
    c = load_file(tmp_path / "nf4" / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(a[key], b[key]) and not torch.equal(a[key], c[key])


@pytest.mark.parametrize("limit", ["-1", "0"])
def test_save_total_limit_below_one_is_refused(cli, tmp_path, limit, no_model_load):
    rc, _, err = cli("train", "--save_total_limit", limit, "--output_dir", tmp_path / "run")
    assert rc == 2 and "'save_total_limit'" in err and "delete every checkpoint" in err


def test_the_offline_alias_is_named_by_its_hub_id_and_loads_from_the_copy_it_was_trained_on(tmp_path, monkeypatch,
                                                                                            base, adapter):
    """The offline default's adapter names the hub model its GGUF was made from (portable: PEFT finds it on
    any machine online) and records the converted folder it was trained on: qerl loads that exact copy while
    it exists, PEFT loads the adapter on it, and on a machine without it the hub id is what is left."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qerl.checkpoint import load_adapter, save_adapter
    from qerl.checkpoint.peft_adapter import peft_base_name, recorded_base_local
    from qerl.model import load_policy
    from qerl.model.adapter_start import base_of, base_to_load

    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.setenv("QERL_CACHE", str(tmp_path / "cache"))
    assert peft_base_name("smollm2") == hub and peft_base_name("/some/folder") == "/some/folder"
    local = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    shutil.copytree(base, local)  # stands in for the converted model
    pol = load_policy(str(local), "nvfp4", lora_rank=4, device="cpu", dtype=torch.float32, progress=False)
    load_adapter(pol, adapter)
    save_adapter(pol.model, tmp_path / "a", base_model_name_or_path="smollm2")  # as the trainer saves
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == hub
    assert recorded_base_local(tmp_path / "a") == local.resolve()
    assert base_to_load(tmp_path / "a") == str(local.resolve()) and base_of(tmp_path / "a") == hub
    m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_to_load(tmp_path / "a")), tmp_path / "a")
    assert m.peft_config["default"].r == 4
    shutil.rmtree(local)  # the adapter on another machine
    assert recorded_base_local(tmp_path / "a") is None and base_to_load(tmp_path / "a") == hub


def _run_folder(path):
    """A run folder as `qerl train` leaves it (what the guard must never delete)."""
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    (path / "config.yaml").write_text("max_steps: 1\n")
    (path / "checkpoint-1").mkdir()
    (path / "checkpoint-1" / "trainer_state.json").write_text("{}")
    return path


@pytest.mark.parametrize("overwrite", [False, True])
def test_quantize_never_replaces_a_run_folder(cli, tmp_path, base, overwrite, no_model_load):
    run = _run_folder(tmp_path / "runs" / "r1")
    before = _tree(run)
    rc, _, err = cli("quantize", base, run, *(["--overwrite"] if overwrite else []))
    assert rc == 2 and "holds a training run" in err and "quantize" in err, err
    assert _tree(run) == before


def test_quantize_into_a_folder_holding_notes_needs_overwrite(cli, tmp_path, base, no_model_load):
    out = tmp_path / "DIR"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "n.txt").write_text("mine")
    rc, _, err = cli("quantize", base, out)
    assert rc == 2 and "not empty" in err and "notes" in err and "--overwrite" in err
    assert (out / "notes" / "n.txt").read_text() == "mine"


def test_quantize_with_overwrite_replaces_a_plain_folder(cli, tmp_path, base):
    out = tmp_path / "DIR"
    (out / "notes").mkdir(parents=True)
    (out / "notes" / "n.txt").write_text("old")
    rc, out_text, err = cli("quantize", base, out, "--overwrite")
    assert rc == 0, err
    assert (out / "config.json").is_file() and not (out / "notes").exists()


def test_quantize_never_replaces_the_model_it_reads(cli, base, no_model_load):
    before = _tree(base)
    rc, _, err = cli("quantize", base, base, "--overwrite")
    assert rc == 2 and "the model" in err and "would delete it" in err
    assert _tree(base) == before


@pytest.mark.parametrize("command", ["export", "quantize"])
def test_a_run_two_levels_down_is_refused_even_with_overwrite(cli, tmp_path, base, command, no_model_load):
    proj = tmp_path / "PROJ"
    run = _run_folder(proj / "experiments" / "r1")
    (proj / "README.md").write_text("my project")
    before = _tree(proj)
    rc, _, err = cli(command, base, proj, "--overwrite")
    assert rc == 2 and "holds a training run" in err and str(run) in err, err
    assert _tree(proj) == before


@pytest.mark.parametrize("command", ["export", "quantize"])
def test_the_current_folder_is_refused_before_loading(cli, tmp_path, base, command, monkeypatch, no_model_load):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for target in (".", str(tmp_path)):  # the current folder, and a folder holding it
        rc, _, err = cli(command, base, target, "--overwrite")
        assert rc == 2 and "current" in err and "empty name" not in err, err
    assert (work / "notes.txt").read_text() == "mine"


def test_an_export_beside_a_run_still_works(cli, tmp_path, base):
    """The guard looks below OUTPUT_DIR, not beside it: a run next to the output folder is no reason to refuse."""
    _run_folder(tmp_path / "r1")
    out = tmp_path / "merged"
    out.mkdir()
    (out / "old.txt").write_text("x")
    rc, _, err = cli("export", base, out, "--overwrite")
    assert rc == 0, err
    assert (out / "config.json").is_file() and (tmp_path / "r1" / "metrics.jsonl").is_file()
