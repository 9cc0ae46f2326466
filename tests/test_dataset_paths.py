"""A dataset path that is not a regular file (a FIFO, a link to /dev/zero, a broken link): one line that
names the path and what it is, before the model loads, without opening it (a FIFO's reader waits for a
writer forever; /dev/zero never ends)."""

from __future__ import annotations

import os
import threading

import pytest

from qerl.tasks.data import load_file

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="POSIX")


@pytest.fixture
def unblock():
    """Should the code open a FIFO for reading, a writer comes and goes after a while, so that the test
    fails on its message instead of hanging."""
    fifos, stop = [], threading.Event()

    def writer():
        while not stop.wait(0.5):
            for f in fifos:
                try:
                    os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while no reader has it open
                except OSError:
                    pass

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    yield fifos
    stop.set()
    t.join()


def dataset(tmp_path, kind, fifos):
    if kind == "fifo":
        p = tmp_path / "rows.jsonl"
        os.mkfifo(p)
    elif kind == "fifo without a suffix":  # not taken for a data file by its name: still not a hub id
        p = tmp_path / "rows"
        os.mkfifo(p)
    else:
        p = tmp_path / "rows.jsonl"
        p.symlink_to("/dev/zero")
    fifos.append(p)
    return p


WHAT = {"fifo": "is a FIFO (named pipe), not a regular file", "fifo without a suffix": "is a FIFO (named pipe), not a "
        "regular file", "link to /dev/zero": "(a link to /dev/zero): is a character device, not a regular file"}


@pytest.mark.parametrize("kind", list(WHAT))
@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_dataset_that_is_not_a_regular_file_is_named(cli, model, tmp_path, unblock, no_model_load, command, kind):
    data = dataset(tmp_path, kind, unblock)
    rc, _, err = cli(command, "--model_name_or_path", model, "--dataset_name", data, "--max_steps", "1",
                     "--report_to", "none", "--output_dir", tmp_path / "run")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith(f"qerl {command}: error: ") and str(data) in last and WHAT[kind] in last, err
    assert not (tmp_path / "run").exists()


def test_load_file_names_what_the_path_is(tmp_path, unblock):
    fifo = dataset(tmp_path, "fifo", unblock)
    with pytest.raises(ValueError, match=f"{fifo}: is a FIFO"):
        load_file(fifo)
    broken = tmp_path / "gone.jsonl"
    broken.symlink_to(tmp_path / "nowhere.jsonl")
    with pytest.raises(FileNotFoundError, match="a link to .*nowhere.jsonl, which does not exist"):
        load_file(broken)
    with pytest.raises(ValueError, match="is a folder"):
        load_file(tmp_path)
