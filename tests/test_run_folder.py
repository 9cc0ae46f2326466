"""Issue 22, data must never be lost: one run per folder, a lock against concurrent runs (stale
locks of dead processes taken over), resume from the newest checkpoint that verifies, partial
metrics lines and killed saves' temporary folders cleaned up."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from qerl.model import random_policy
from qerl.rl import GRPOConfig, GRPOTrainer
from qerl.train import checkpoints as ckpt
from qerl.train.metrics import read_metrics
from qerl.train.run_folder import LOCK, RunFolderError, RunLock
from qerl.tasks import get_task
from tiny_models import config, tiny_tokenizer


def sevens(completions, **_):
    return [c.count("7") / max(1, len(c)) for c in completions]


def _trainer(out, **kw):
    torch.manual_seed(0)
    pol = random_policy(config("qwen2"), "nvfp4", lora_rank=4, device="cpu", dtype=torch.float32, std=0.05,
                        progress=False)
    pol.tokenizer = tiny_tokenizer()
    cfg = GRPOConfig(**{**dict(max_steps=2, generation_batch_size=8, num_generations=4, per_device_train_batch_size=8,
                                max_completion_length=6, max_prompt_length=48, aqn_stages=2, output_dir=str(out),
                                save_steps=1, save_total_limit=2, report_to="none", dynamic_sampling=False), **kw})
    return GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=20), reward_funcs=[sevens], progress=False)


def _steps(run):
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run (checkpoint-1, checkpoint-2), copied per test."""
    run = tmp_path_factory.mktemp("src") / "run"
    _trainer(run).train()
    return run


@pytest.fixture
def run(finished, tmp_path):
    import shutil

    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


# ---- one run per folder ----------------------------------------------------------------------------
def test_a_fresh_run_into_a_used_folder_is_refused_and_nothing_changes(run):
    before = {p.name: p.stat().st_mtime_ns for p in run.rglob("*")}
    with pytest.raises(RunFolderError, match=r"already holds a run .*--resume .*--overwrite_output_dir"):
        _trainer(run, max_steps=1).train()
    assert {p.name: p.stat().st_mtime_ns for p in run.rglob("*")} == before
    assert not (run / LOCK).exists()


def test_the_used_folders_resume_hint_is_the_command_as_the_user_ran_it(tmp_path, monkeypatch):
    """The README runs `.venv/bin/qerl`, whose folder is not on the PATH: the hint must paste as is."""
    import sys

    from qerl.train.run_folder import refuse_or_clear

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "qerl").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(venv / "qerl"), "train"])
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RunFolderError) as e:
        refuse_or_clear(tmp_path, overwrite=False)
    assert f"`venv/bin/qerl train --resume {tmp_path}`" in str(e.value), str(e.value)


def test_overwrite_output_dir_replaces_the_earlier_run_entirely(run):
    _trainer(run, max_steps=1, overwrite_output_dir=True).train()
    # the old checkpoint-2 would outrank the new run's checkpoint-1 in rotation and resume
    assert [p.name for p in ckpt.checkpoints(run)] == ["checkpoint-1"] and _steps(run) == [1]


def test_the_cli_refuses_before_loading_the_model(run, monkeypatch):
    import argparse

    from qerl.cli import train

    monkeypatch.setattr("qerl.model.load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    args = argparse.Namespace(overrides=["--output_dir", str(run)], resume=None, print_config=False)
    with pytest.raises(ValueError, match="already holds a run"):
        train.run(args)


# ---- the lock --------------------------------------------------------------------------------------
def test_a_second_process_is_kept_out_of_a_folder_in_use(tmp_path):
    mine = RunLock(tmp_path)
    mine.acquire()
    code = (f"from qerl.train.run_folder import RunLock\nRunLock({str(tmp_path)!r}).acquire()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode != 0 and f"pid {os.getpid()}" in p.stderr and "another qerl run" in p.stderr
    mine.release()
    assert not (tmp_path / LOCK).exists()
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0  # free again


def test_the_trainer_refuses_a_folder_locked_by_a_live_process(run):
    (run / LOCK).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))  # alive: our parent
    tr = _trainer(run)
    with pytest.raises(RunFolderError, match="another qerl run is using this folder"):
        tr.resume()


def test_a_stale_lock_of_a_killed_process_is_taken_over(run):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    p.kill()
    p.wait()  # its pid is now free: the lock it "left" is stale
    (run / LOCK).write_text(json.dumps({"pid": p.pid, "host": socket.gethostname(), "started": 0}))
    tr = _trainer(run, max_steps=3)
    assert tr.resume() == 2
    tr.train()
    assert _steps(run) == [1, 2, 3] and not (run / LOCK).exists()


def test_another_hosts_lock_is_respected(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    with pytest.raises(RunFolderError, match="pid 1 on elsewhere"):
        RunLock(tmp_path).acquire()


# ---- resume from what verifies ---------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["trainable", "optimizer", "state", "state_keys", "no_state"])
def test_resume_skips_a_corrupt_latest_checkpoint_and_says_why(run, damage, capsys):
    c2 = run / "checkpoint-2"
    if damage in ("trainable", "optimizer"):
        f = c2 / f"{damage}.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        named = f.name
    elif damage == "state":
        (c2 / "trainer_state.json").write_text('{"step": 2, "optim')
        named = "trainer_state.json"
    elif damage == "state_keys":
        (c2 / "trainer_state.json").write_text('{"step": 2}')
        named = "trainer_state.json"
    else:
        (c2 / "trainer_state.json").unlink()
        named = "trainer_state.json"
    tr = _trainer(run, max_steps=3)
    assert tr.resume() == 1
    said = capsys.readouterr().out
    assert "skipping checkpoint-2" in said and named in said
    assert (run / "checkpoint-2.corrupt").is_dir()  # kept for a look, out of rotation and resume
    tr.train()
    assert [p.name for p in ckpt.checkpoints(run)] == ["checkpoint-2", "checkpoint-3"]
    assert _steps(run) == [1, 2, 3]


def test_resume_fails_naming_the_file_when_no_checkpoint_verifies(run):
    for c in ckpt.checkpoints(run):
        (c / "rng.safetensors").write_bytes(b"\x00garbage")
    tr = _trainer(run, max_steps=3)
    with pytest.raises(ckpt.CorruptCheckpoint, match=r"checkpoint-2/rng\.safetensors.*checkpoint-1/rng\.safetensors"):
        tr.resume()
    assert not (run / LOCK).exists()
    with pytest.raises(ckpt.CorruptCheckpoint, match=r"checkpoint-1/rng\.safetensors: unreadable"):
        tr.resume(run / "checkpoint-1")  # an explicit checkpoint: no fallback


def test_a_partial_last_metrics_line_is_dropped_with_a_note(run, capsys):
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "reward_me')  # the kill came mid-write
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert "dropped its last line" in capsys.readouterr().out
    tr = _trainer(run, max_steps=3)
    tr.resume()
    tr.train()
    assert _steps(run) == [1, 2, 3]


def test_a_bad_metrics_line_in_the_middle_is_an_error_naming_file_and_line(run):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text(lines[0] + "\n{garbage\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a metrics row"):
        read_metrics(run)


def test_temporary_folders_of_a_killed_save_are_removed_at_the_next_start(run):
    (run / ".checkpoint-3.abc123").mkdir()
    (run / ".checkpoint-3.abc123" / "trainable.safetensors").write_bytes(b"half")
    (run / ".old-checkpoint-2").mkdir()
    (run / "metrics.jsonl.tmp").write_text("{")
    tr = _trainer(run, max_steps=3)
    tr.resume()
    left = sorted(p.name for p in run.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp"))
    assert left == [LOCK]  # only our own lock, held until train() ends
    tr.train()
    assert not (run / LOCK).exists()


def test_a_run_killed_mid_save_resumes_from_the_last_complete_checkpoint(run):
    """SIGKILL during a save: the temporary folder is what it leaves (the rename never happened)."""
    code = f"""
import os, signal, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import qerl.train.checkpoints as st
from test_run_folder import _trainer
real = st.save_file
def dying(tensors, path, *a, **k):
    real(tensors, path, *a, **k)
    if '.checkpoint-3.' in str(path):
        os.kill(os.getpid(), signal.SIGKILL)
st.save_file = dying
tr = _trainer({str(run)!r}, max_steps=3)
tr.resume()
tr.train()
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == -9, p.stderr[-2000:]
    assert [x.name for x in run.iterdir() if x.name.startswith(".checkpoint-3.")]  # the killed save's leftovers
    assert json.loads((run / LOCK).read_text())["pid"] != os.getpid()  # and its lock, now stale
    tr = _trainer(run, max_steps=3)
    assert tr.resume() == 2
    tr.train()
    assert [x.name for x in ckpt.checkpoints(run)] == ["checkpoint-2", "checkpoint-3"]
    assert not [x for x in run.iterdir() if x.name.startswith(".")]
    assert _steps(run) == [1, 2, 3]
