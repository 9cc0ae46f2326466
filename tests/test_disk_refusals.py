"""A disk that refuses a write (full: ENOSPC; a file past the process's size limit: EFBIG) ends `qerl train` and
`qerl sft` in one line naming the folder, what was kept (the last good checkpoint) and how to go on, exit
status 2, nothing lost. Injected where safetensors writes (its Rust error carries only "(os error N)"), and once
for real: `ulimit -f` in a subprocess."""

from __future__ import annotations

import errno
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runs import sft_args, train_args

SRC = str(Path(__file__).resolve().parents[1] / "src")
TEXT = {errno.ENOSPC: "No space left on device (os error 28)", errno.EFBIG: "File too large (os error 27)"}
SAID = {errno.ENOSPC: "no space left on the disk of {run}", errno.EFBIG: "a file in {run} went past the file-size limit"}


def _two_steps(command, model, run):
    return (train_args(model, run) if command == "train" else
            sft_args(model, run, "--max_steps", "2", "--save_steps", "1", "--save_total_limit", "2"))


def _checkpoints(run):
    return sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint"))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG], ids=["ENOSPC", "EFBIG"])
@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_refused_save_is_one_line_naming_the_folder_and_what_is_kept(cli, tmp_path, model, monkeypatch, command,
                                                                       code):
    from safetensors import SafetensorError

    import qerl.train.checkpoints as state

    real, calls = state.save_file, []

    def refuse(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) > 3:  # checkpoint-1 whole (trainable, optimizer, rng), then the disk refuses
            raise SafetensorError(f"Error while serializing: I/O error: {TEXT[code]}")
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(state, "save_file", refuse)
    run = tmp_path / "run"
    rc, _, err = cli(*_two_steps(command, model, run))
    last = err.strip().splitlines()[-1]  # after the load's and the bar's progress lines
    assert rc == 2 and last.startswith(f"qerl {command}: error: " + SAID[code].format(run=run)), err
    assert f"saved: {run / 'checkpoint-1'}" in last and f"qerl {command} --resume {run}" in last
    assert _checkpoints(run) == ["checkpoint-1"]  # the last good one kept whole, no temporary beside it
    assert not [p for p in run.iterdir() if ".qerl-tmp-" in p.name]


def test_a_refusal_before_any_checkpoint_says_to_start_again(cli, tmp_path, model, monkeypatch):
    import qerl.train.checkpoints as state

    def refuse(*a, **k):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(state, "save_file", refuse)
    run = tmp_path / "run"
    rc, _, err = cli(*sft_args(model, run))
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "went past the file-size limit" in last and "no checkpoint saved yet" in last, err
    assert "--resume" not in last and "start again with the same command" in last


def _limited(limit: int):
    def pre():  # the file-size limit, with SIGXFSZ at its default: qerl must not be killed by it
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    return pre


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_FSIZE"), reason="needs a file-size limit")
def test_sft_past_a_real_file_size_limit_keeps_its_checkpoint(model, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    qerl = [sys.executable, "-m", "qerl"]
    first = subprocess.run([*qerl, *map(str, sft_args(model, run, "--save_steps", "1"))], capture_output=True,
                           text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    biggest = max(p.stat().st_size for p in (run / "checkpoint-1").rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in (run / "checkpoint-1").rglob("*") if p.is_file()}
    # the same files of checkpoint-2 cannot be written whole
    r = subprocess.run([*qerl, "sft", "--resume", str(run), "--max_steps", "2"], capture_output=True, text=True,
                       env=env, timeout=300, preexec_fn=_limited(biggest - 1))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"qerl sft: error: a file in {run} went past the file-size limit"), last
    assert f"saved: {run / 'checkpoint-1'}" in last and f"sft --resume {run}" in last
    assert _checkpoints(run) == ["checkpoint-1"]
    assert {p: p.read_bytes() for p in before} == before  # what was kept is unchanged
