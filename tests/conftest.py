import os
import sys
from pathlib import Path

import torch as _torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before any kernel is defined.
if not _torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/reference_ct.py, tiny_models.py


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def cli(capsys):
    """Run `qerl ...` through the CLI's entry point: (exit code, stdout, stderr); never a traceback."""
    from qerl.cli import main

    def run(*args):
        try:
            rc = main([str(a) for a in args])
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
        out = capsys.readouterr()
        assert "Traceback" not in out.err
        return rc, out.out, out.err
    return run


def _tiny_llama(tmp_path_factory, name: str) -> Path:
    """A tiny Llama folder (128 positions) with its tokenizer, named `name`."""
    from tiny_models import save_tiny, tiny_tokenizer

    d = tmp_path_factory.mktemp("m") / name
    save_tiny(d, "llama")
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The command-line tests' model: a tiny Llama folder (128 positions) with its tokenizer."""
    return _tiny_llama(tmp_path_factory, "m")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The export and data-loss tests' base model: the same tiny Llama, in a folder named base."""
    return _tiny_llama(tmp_path_factory, "base")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The TRL-style tests' model: a tiny Llama folder (1024 positions, room for chat templates) with its tokenizer."""
    from tiny_models import save_tiny, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny") / "model"
    save_tiny(d, "llama", max_position_embeddings=1024)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a model loads (bad input must be reported before any loading)."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr("qerl.model.load_policy", refuse)
    monkeypatch.setattr("qerl.train.parts.load_policy", refuse, raising=False)
