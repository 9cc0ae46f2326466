"""Issue 40, data lost: `qerl quantize` asks the same guard as `qerl export` (a run folder, a folder
holding one at any depth, the model itself, the current folder: refused even with --overwrite; a folder
holding anything: only with --overwrite); `qerl export ... PROJ --overwrite` refuses a run two levels
down; `qerl export ... .` is refused before loading (it failed after loading with an empty name)."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny, tiny_tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "base"
    save_tiny(d, "llama")
    tiny_tokenizer().save_pretrained(d)
    return d


def _run_folder(path):
    """A run folder as `qerl train` leaves it (what the guard must never delete)."""
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    (path / "config.yaml").write_text("max_steps: 1\n")
    (path / "checkpoint-1").mkdir()
    (path / "checkpoint-1" / "trainer_state.json").write_text("{}")
    return path


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


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
