"""Exports write what they read, and checkpoint loading says what it does (issue 60, "exports and checkpoint
loading"). Each against an independent reference: files the real llm-compressor wrote, compressed-tensors' own
ignore-list rule, transformers' and PEFT's loaders, and real processes for signals.

- `qerl export` merges the layers the run kept in bf16 (modules_to_not_convert) from their bf16 weights;
- `save_compressed` writes what llm-compressor writes: the base's Linear modules left dense in `ignore` (never
  the LoRA factors), dense tensors in the base's dtype;
- a packed tensor stored in another dtype than the format's is read converted only where exact, and said, and
  otherwise refused naming the file, the tensor and the dtype;
- a NaN anywhere in a checkpoint is one line naming the file and tensor, exit status 2, with no warning first;
- `qerl export OTHER --adapter A` is refused unless --allow-other-base;
- SIGTERM during `qerl export` removes its temporary and says so in one line, status 143.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_runs import one_line
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import save_tiny, tiny_tokenizer

from qerl.checkpoint import save_adapter
from qerl.checkpoint.compressed_tensors import save_compressed
from qerl.model import load_policy

FIX = Path(__file__).parent / "fixtures" / "lc_tiny_llama"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _random_lora(pol, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in pol.model.modules():
            if hasattr(m, "lora_B") and getattr(m, "r", 0):
                m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.05)


@pytest.fixture(scope="module")
def kept_adapter(tmp_path_factory, base):
    """An adapter trained (random B) on an NVFP4 base whose down_proj layers the run kept in bf16."""
    pol = load_policy(str(base), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False,
                      modules_to_not_convert=["down_proj"])
    _random_lora(pol)
    return save_adapter(pol, tmp_path_factory.mktemp("r") / "adapter")


# ---- 1. the layers the run kept in bf16 -------------------------------------------------------------------
def test_export_merges_the_kept_layers_from_their_bf16_weights(cli, tmp_path, base, kept_adapter):
    """Reference: PEFT's own merge of the adapter into the base's bf16 weights (what the run trained on for the
    kept layers). Before: down_proj came out merged into its NVFP4 rounding, with no word."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    rc, stdout, err = cli("export", base, out, "--adapter", kept_adapter, "--dtype", "float32")
    assert rc == 0, err
    assert "as the run kept them (modules_to_not_convert ['down_proj']" in stdout and "2 layers" in stdout
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                    kept_adapter).merge_and_unload().state_dict()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()  # transformers reloads it
    for i in range(2):
        down, up = f"model.layers.{i}.mlp.down_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"
        assert torch.allclose(merged[down], ref[down], rtol=0, atol=1e-6), down
        assert not torch.allclose(merged[up], ref[up], rtol=0, atol=1e-4)  # a quantized layer: its rounding
    # qerl's loader reads the export back: the kept layers are exactly what was written
    again = load_policy(str(out), "bf16", lora_rank=0, dtype=torch.float32, progress=False)
    w = again.model.model.layers[0].mlp.down_proj.dequantized_weight(torch.float32)
    assert torch.equal(w, merged["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16).float())


# ---- 2. save_compressed writes what llm-compressor writes ----------------------------------------------------
def _header(path):
    with safe_open(str(path), "pt") as h:
        return {k: (h.get_slice(k).get_dtype(), h.get_slice(k).get_shape()) for k in h.keys()}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_save_compressed_of_a_lora_policy_is_llm_compressors_checkpoint(tmp_path, fmt):
    """The fixture's bf16 model, loaded with LoRA and computing in fp32, written by save_compressed: the same
    quantization_config (ignore ["lm_head"], not the LoRA factors), the same tensors, dtypes and bytes as the
    real llm-compressor wrote for it. Before: 28 LoRA submodules in ignore and fp32 dense tensors."""
    pol = load_policy(str(FIX / "bf16"), fmt, lora_rank=8, dtype=torch.float32, progress=False)
    _random_lora(pol)
    out = save_compressed(pol, tmp_path / "ct")
    theirs = FIX / f"{fmt}a16"
    q, q_ref = (json.loads((f / "config.json").read_text())["quantization_config"] for f in (out, theirs))
    assert q["ignore"] == q_ref["ignore"] == ["lm_head"]
    assert {**q, "version": None} == {**q_ref, "version": None}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == json.loads((theirs / "config.json").read_text())["dtype"] == "bfloat16"
    assert _header(out / "model.safetensors") == _header(theirs / "model.safetensors")
    a, b = load_file(out / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in b)
    assert (out / "model.safetensors").stat().st_size == (theirs / "model.safetensors").stat().st_size


def _compressed_tensors_ignore(folder, ignore):
    """compressed-tensors' own rule for the ignore list llm-compressor writes (QuantizationConfig.from_pretrained
    on a model with the schemes applied): every Linear the recipe left dense, by its full name."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=ignore))
    return QuantizationConfig.from_pretrained(model).ignore


def test_save_compressed_keeps_the_kept_layers_dense_and_lists_them_as_compressed_tensors_does(tmp_path, base):
    pol = load_policy(str(base), "nvfp4", lora_rank=4, dtype=torch.float32, progress=False,
                      modules_to_not_convert=["down_proj"])
    _random_lora(pol)
    out = save_compressed(pol, tmp_path / "ct")
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    assert q["ignore"] == _compressed_tensors_ignore(base, ["lm_head", "re:.*down_proj"])
    assert q["ignore"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "lm_head"]
    written, source = load_file(out / "model.safetensors"), load_file(base / "model.safetensors")
    assert {t.dtype for k, t in written.items() if not k.endswith(("_packed", "_scale"))} == {torch.bfloat16}
    for i in range(2):
        k = f"model.layers.{i}.mlp.down_proj.weight"
        assert torch.equal(written[k], source[k])  # the base's own bf16 weight, not a rounding of it
    # transformers (with compressed-tensors) loads it: the kept layers dense, equal to the base's
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(hf.model.layers[1].mlp.down_proj.weight, source["model.layers.1.mlp.down_proj.weight"])
    # and qerl's loader keeps them in bf16 from the ignore list, the rest packed
    again = load_policy(str(out), "auto", lora_rank=0, progress=False)
    fmts = {n: m.fmt.name for n, m in again.model.model.layers[0].mlp.named_children() if hasattr(m, "fmt")}
    assert fmts == {"gate_proj": "nvfp4", "up_proj": "nvfp4", "down_proj": "bf16"}
    ids = torch.randint(3, 150, (2, 9))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, again.model(ids).logits)


# ---- 3. a packed tensor in another dtype than the format's -------------------------------------------------
@pytest.fixture(scope="module")
def compressed(tmp_path_factory, base):
    return save_compressed(load_policy(str(base), "nvfp4", lora_rank=0, progress=False),
                           tmp_path_factory.mktemp("ct") / "ct")


def _edited(src, dst, edit):
    shutil.copytree(src, dst)
    sd = load_file(dst / "model.safetensors")
    edit(sd)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


SCALE = "model.layers.0.self_attn.q_proj.weight_scale"


def test_a_weight_scale_in_fp32_on_the_fp8_grid_is_read_converted_and_said(compressed, tmp_path, caplog):
    f32 = _edited(compressed, tmp_path / "f32", lambda sd: sd.update({SCALE: sd[SCALE].float()}))
    with caplog.at_level(logging.WARNING):
        b = load_policy(str(f32), "auto", lora_rank=0, progress=False).model
    said = [r.getMessage() for r in caplog.records if "converted" in r.getMessage()]
    assert len(said) == 1 and str(f32 / "model.safetensors") in said[0] and repr(SCALE) in said[0]
    assert "torch.float32 where the format stores torch.float8_e4m3fn" in said[0]
    a = load_policy(str(compressed), "auto", lora_rank=0, progress=False).model
    ids = torch.randint(3, 150, (2, 8))
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


@pytest.mark.parametrize("edit", ["off_grid", "mxfp4_float"])
def test_a_packed_tensor_in_another_dtype_is_one_line_naming_file_tensor_and_dtype(cli, tmp_path, base, compressed,
                                                                                  edit):
    if edit == "off_grid":
        def change(sd):
            s = sd[SCALE].float()
            s[0, 0] *= 1.01  # between two FP8-E4M3 values
            sd[SCALE] = s
        bad, want = _edited(compressed, tmp_path / "bad", change), "torch.float8_e4m3fn"
    else:
        mx = save_compressed(load_policy(str(base), "mxfp4", lora_rank=0, progress=False), tmp_path / "mx")
        bad = _edited(mx, tmp_path / "bad", lambda sd: sd.update({SCALE: sd[SCALE].float()}))
        want = "torch.uint8"
    rc, _, err = cli("generate", bad, "--prompt", "hi", "--max_new_tokens", "1")
    assert rc == 2 and one_line(err), err
    assert f"{bad / 'model.safetensors'}: tensor {SCALE!r} is torch.float32, expected {want}" in err


# ---- 4. NaN in a base weight: one line, status 2 --------------------------------------------------------------
def _with_nan(base, dst, key, index):
    def edit(sd):
        sd[key][index] = float("nan")
    return _edited(base, dst, edit)


def test_a_nan_projection_weight_is_one_line_with_no_warning_first(tmp_path, base):
    """What the user sees, in a real process: before, a "leaving this layer in bf16" warning and its source
    line (a traceback's look) came first, then the error."""
    bad = _with_nan(base, tmp_path / "nan", "model.layers.1.self_attn.o_proj.weight", (3, 3))
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "qerl", "generate", str(bad), "--prompt", "hi", "--max_new_tokens", "2"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 2 and one_line(p.stderr), p.stderr
    assert p.stderr.startswith(f"qerl generate: error: {bad / 'model.safetensors'}: model.layers.1.self_attn.o_proj"
                               ".weight holds NaN or inf (first at index [3, 3])"), p.stderr


@pytest.mark.parametrize("key,index", [("model.norm.weight", (5,)), ("model.embed_tokens.weight", (7, 2))])
def test_a_nan_in_any_base_tensor_is_refused_by_file_and_name(cli, tmp_path, base, key, index, recwarn):
    """Before: a NaN outside the projections loaded with exit 0 (and trained on zero rewards)."""
    bad = _with_nan(base, tmp_path / "nan", key, index)
    rc, _, err = cli("generate", bad, "--prompt", "hi", "--max_new_tokens", "2")
    assert rc == 2 and one_line(err), err
    assert f"{bad / 'model.safetensors'}: {key} holds NaN or inf (first at index {list(index)})" in err
    assert not [w for w in recwarn if "bf16" in str(w.message)]


# ---- 5. the adapter's base ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def other(tmp_path_factory):
    d = tmp_path_factory.mktemp("o") / "other"
    save_tiny(d, "llama", seed=1)
    tiny_tokenizer().save_pretrained(d)
    return d


def test_export_into_another_base_is_refused_naming_both(cli, tmp_path, base, other, kept_adapter, no_model_load):
    rc, _, err = cli("export", other, tmp_path / "out", "--adapter", kept_adapter)
    assert rc == 2 and one_line(err), err
    assert f"{other}: not the base the adapter was trained on" in err
    assert f"base_model_name_or_path {base.resolve()}" in err and "--allow-other-base" in err


def test_export_into_another_base_with_the_flag_says_so(cli, tmp_path, base, other, kept_adapter):
    rc, stdout, err = cli("export", other, tmp_path / "out", "--adapter", kept_adapter, "--allow-other-base")
    assert rc == 0, err
    assert f"merging the adapter trained on {base.resolve()} into {other}" in stdout


def test_the_same_base_spelt_otherwise_is_the_same(cli, tmp_path, base, kept_adapter, monkeypatch):
    monkeypatch.chdir(base.parent)
    rc, _, err = cli("export", f"./{base.name}/", tmp_path / "out", "--adapter", kept_adapter)
    assert rc == 0, err


# ---- 6. SIGTERM while the export writes ---------------------------------------------------------------------
SIGTERM_AT_WRITE = """
import os, signal, sys
from qerl.checkpoint import atomic
def hook(stage):
    if stage == "writing":
        os.kill(os.getpid(), signal.SIGTERM)
atomic.fault_hook = hook
{body}
"""


def _run(body, *args):
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    code = SIGTERM_AT_WRITE.format(body=body)
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=300)


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".qerl-" in p.name)


@pytest.mark.parametrize("existing", [False, True])
def test_sigterm_while_export_writes_cleans_up_and_says_so(tmp_path, base, existing):
    """Before: the process died on the spot (status -15), no word, its .out.qerl-tmp-* left behind."""
    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    p = _run("from qerl.cli import main\nsys.exit(main(sys.argv[1:]))", "export", base, out,
             *(["--overwrite"] if existing else []))
    assert p.returncode == 143, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("qerl export: stopped by SIGTERM; nothing written (the output folder "
                                                 "is unchanged)")
    assert _leftovers(tmp_path) == []
    assert (out / "notes.txt").read_text() == "mine" if existing else not out.exists()


def test_sigterm_inside_any_atomic_folder_removes_its_temporary(tmp_path):
    """The rule lives where the temporary is owned (checkpoint/atomic.py): any writer, no CLI around it."""
    body = """
import torch
from qerl.checkpoint.atomic import atomic_folder, entries, write_sharded
with atomic_folder(sys.argv[1]) as tmp:
    write_sharded(tmp, entries({"a": torch.zeros(4), "b": torch.ones(4)}))
"""
    p = _run(body, tmp_path / "target")
    assert p.returncode == 143 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert _leftovers(tmp_path) == [] and not (tmp_path / "target").exists()
