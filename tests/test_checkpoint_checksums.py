"""Checkpoints and the final adapter verify: bytes changed inside a checkpoint fall back to the previous one,
naming the changed file; a checkpoint whose checksums.json is missing, empty or leaves a file out is
skipped when the run's other checkpoints have checksums; the final adapter is verified wherever it loads."""

from __future__ import annotations

import json
import shutil

import pytest
from cli_runs import train_args



def kept_args(model, out, *extra):
    """The short run, keeping two checkpoints."""
    return train_args(model, out, "--save_total_limit", "2", *extra)


# ---- checkpoints: checksums written at save, verified at resume -----------------------------------
def test_bytes_flipped_inside_a_checkpoint_fall_back_to_the_previous_one(cli, model, tmp_path):
    from safetensors.torch import load_file

    run = tmp_path / "run"
    assert cli(*kept_args(model, run))[0] == 0
    assert json.loads((run / "checkpoint-2" / "checksums.json").read_text())["files"]["trainable.safetensors"]
    f = run / "checkpoint-2" / "trainable.safetensors"
    data = bytearray(f.read_bytes())
    data[-200:-136] = bytes(b ^ 0x5A for b in data[-200:-136])  # 64 bytes inside the last tensor, same size
    f.write_bytes(bytes(data))
    one = load_file(run / "checkpoint-1" / "trainable.safetensors")
    rc, out, err = cli("train", "--resume", run, "--max_steps", "2")
    assert rc == 0, err
    assert "skipping checkpoint-2" in out and "bytes changed" in out and "at step 1/2" in out
    assert (run / "checkpoint-2.corrupt").is_dir()
    # the rerun step 2 started from checkpoint-1's values (a fresh checkpoint-2 was written from them)
    assert set(load_file(run / "checkpoint-2" / "trainable.safetensors")) == set(one)


def test_checksums_name_the_changed_file(tmp_path):
    from qerl.checkpoint.checksums import ChecksumError, verify_checksums, write_checksums

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"\0" * 100)
    (tmp_path / "y.json").write_text("{}")
    write_checksums(tmp_path)
    assert verify_checksums(tmp_path)
    (tmp_path / "a" / "x.bin").write_bytes(b"\0" * 99 + b"\1")
    with pytest.raises(ChecksumError, match=r"x\.bin: its bytes changed"):
        verify_checksums(tmp_path)
    (tmp_path / "y.json").unlink()
    assert not verify_checksums(tmp_path / "a")  # no checksums.json: not checked


@pytest.fixture(scope="module")
def finished(model, tmp_path_factory):
    from qerl.cli import main

    run = tmp_path_factory.mktemp("f") / "run"
    assert main([str(a) for a in kept_args(model, run)]) == 0
    return run


@pytest.fixture
def run(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def _flip(f, at=-200):
    data = bytearray(f.read_bytes())
    data[at:at + 64] = bytes(b ^ 0x5A for b in data[at:at + 64])
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["deleted", "lists_nothing", "leaves_a_file_out"])
def test_a_checkpoint_without_usable_checksums_is_skipped_at_resume(cli, run, damage):
    c2 = run / "checkpoint-2"
    sums = c2 / "checksums.json"
    table = json.loads(sums.read_text())
    _flip(c2 / "trainable.safetensors")  # what the missing checksums would have caught
    if damage == "deleted":
        sums.unlink()
        said = "checksums.json: missing"
    elif damage == "lists_nothing":
        sums.write_text(json.dumps({"algorithm": "sha256", "files": {}}))
        said = "lists no files"
    else:
        del table["files"]["trainable.safetensors"]
        sums.write_text(json.dumps(table))
        said = "trainable.safetensors: not listed"
    rc, out, err = cli("train", "--resume", run, "--max_steps", "2")
    assert rc == 0, err
    assert "skipping checkpoint-2" in out and said in out and "at step 1/2" in out, out
    assert (run / "checkpoint-2.corrupt").is_dir()


def test_the_first_checkpoint_of_a_run_has_no_sibling_to_require_checksums(tmp_path):
    """Checksums are required where the run's other checkpoints have them, not in a lone old checkpoint."""
    from qerl.checkpoint.checksums import ChecksumError, verify_checksums, write_checksums

    for n in (1, 2):
        (tmp_path / f"checkpoint-{n}").mkdir()
        (tmp_path / f"checkpoint-{n}" / "x.bin").write_bytes(b"x")
    assert verify_checksums(tmp_path / "checkpoint-1") is False  # no checkpoint has checksums: an old run
    write_checksums(tmp_path / "checkpoint-2")
    assert verify_checksums(tmp_path / "checkpoint-2") is True
    with pytest.raises(ChecksumError, match="checkpoint-1/checksums.json: missing"):
        verify_checksums(tmp_path / "checkpoint-1")


def test_the_final_adapter_has_checksums_verified_where_it_is_loaded(cli, run, model, tmp_path):
    sums = json.loads((run / "adapter" / "checksums.json").read_text())["files"]
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(sums)
    _flip(run / "adapter" / "adapter_model.safetensors")
    rc, _, err = cli("export", model, tmp_path / "merged", "--adapter", run / "adapter")
    assert rc == 2 and "adapter_model.safetensors" in err and "bytes changed" in err, err
    assert not (tmp_path / "merged").exists()


def test_the_train_adapter_carries_the_tokenizer_under_its_checksums(finished, model):
    from transformers import AutoTokenizer

    adapter = finished / "adapter"
    tok, ref = AutoTokenizer.from_pretrained(adapter), AutoTokenizer.from_pretrained(model)
    text = "12 + 30 = 42, so <answer>42</answer>"
    assert tok(text)["input_ids"] == ref(text)["input_ids"] and tok.chat_template == ref.chat_template
    listed = json.loads((adapter / "checksums.json").read_text())["files"]
    assert {p.name for p in adapter.iterdir() if p.name != "checksums.json"} <= set(listed)
