"""How `qerl` reports an error: one line and a non-zero status for errors that say what went wrong and
what to do (bad input, a run stopped on a non-finite loss), a traceback only for a bug."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny, tiny_tokenizer

from qerl.train.optim import TrainingError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "m"
    save_tiny(d, "llama")
    tiny_tokenizer().save_pretrained(d)
    return d


def test_a_run_stopped_by_a_non_finite_loss_is_one_line(cli, model, tmp_path):
    # a learning rate of 1e30 is finite and positive: the first update overflows, the next loss is NaN
    run = tmp_path / "run"
    rc, _, err = cli("sft", "--model_name_or_path", model, "--max_steps", "4", "--per_device_train_batch_size", "2",
                     "--max_length", "128", "--report_to", "none", "--output_dir", run, "--learning_rate", "1e30",
                     "--save_steps", "1")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("qerl sft: error: ") and "loss is nan" in last, err[-2000:]
    assert str(run / "checkpoint-") in last  # where the run can go on from


def test_only_errors_that_explain_themselves_lose_their_traceback():
    from qerl.cli import said_in_one_line

    assert said_in_one_line(TrainingError("step 3: loss is nan"))
    assert said_in_one_line(ValueError("x")) and said_in_one_line(FileNotFoundError("x"))
    assert not said_in_one_line(RuntimeError("a bug")) and not said_in_one_line(TypeError("a bug"))
