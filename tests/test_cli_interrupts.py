"""Ctrl-C and SIGTERM at any moment of a `qerl` command's start (its imports of torch and transformers
take seconds, many more on a loaded machine): one line, status 130 (143 for SIGTERM), no traceback,
never lost. Real processes, real signals sent to the process group as a terminal does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/PID/status")


def command_args(command, model, tmp_path):
    out = tmp_path / "out"
    return {"train": ["train", "--model", model, "--dataset_name", "arithmetic", "--dataset_config",
                      "{size: 16, eval_size: 4}", "--max_steps", "100000", "--generation_batch_size", "4",
                      "--num_generations", "2", "--per_device_train_batch_size", "4", "--max_completion_length", "4",
                      "--max_prompt_length", "64", "--save_steps", "1", "--report_to", "none",
                      "--parity_check_steps", "0", "--eval_on_start", "false", "--eval_on_end", "false",
                      "--output_dir", out],
            "sft": ["sft", "--model_name_or_path", model, "--max_steps", "100000", "--per_device_train_batch_size",
                    "2", "--max_length", "128", "--report_to", "none", "--output_dir", out],
            "export": ["export", model, out]}[command]


def catches_sigterm(pid: int) -> bool:
    """The process has a handler for SIGTERM: qerl's, installed before its heavy imports (Python itself
    catches only SIGINT). Interpreter start-up before that is outside qerl's reach."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in text.splitlines() if line.startswith("SigCgt:"))
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def interrupt_at(argv_list, moments, sig=signal.SIGINT, wait_for_handler_s=20.0):
    """Start each command, send `sig` to its process group `moments[i]` seconds after qerl's handler is
    in place (timed per process, so a loaded machine shifts nothing), return (returncode, stderr)s."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "qerl", *map(str, a)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env, start_new_session=True) for a in argv_list]
    start = time.monotonic()
    ready: list[float | None] = [None] * len(procs)
    sent = [False] * len(procs)
    while not all(sent):
        now = time.monotonic()
        for i, p in enumerate(procs):
            if sent[i]:
                continue
            if ready[i] is None and (catches_sigterm(p.pid) or now - start > wait_for_handler_s):
                ready[i] = now
            if ready[i] is not None and now >= ready[i] + moments[i]:
                os.killpg(p.pid, sig)
                sent[i] = True
        time.sleep(0.01)
    return [(p.returncode, err) for p in procs for _, err in [p.communicate(timeout=120)]]


def check_one_line(rc, err, command, sig=signal.SIGINT, moment=None):
    name, when = signal.Signals(sig).name, f"{signal.Signals(sig).name} {moment} s after the handler: "
    assert rc == (130 if sig == signal.SIGINT else 143), when + err[-2000:]
    assert "Traceback" not in err and "error_already_set" not in err and "Exception ignored" not in err, when + err[-2000:]
    last = err.strip().splitlines()[-1] if err.strip() else ""
    assert last.startswith(f"qerl {command}: stopped by {name}"), when + last
    if command == "export":
        assert "nothing written" in last
    else:
        assert "checkpoint" in last and ("continue with" in last or "start again with the same command" in last)


MOMENTS = (0.0, 0.2, 0.6, 1.2, 2.0, 3.0)  # seconds after the handler: inside the imports, even on a fast machine


@pytest.mark.parametrize("command", ["train", "sft", "export"])
def test_ctrl_c_in_the_first_seconds_is_one_line(model, tmp_path, command):
    args = [command_args(command, model, tmp_path / str(i)) for i in range(len(MOMENTS))]
    for moment, (rc, err) in zip(MOMENTS, interrupt_at(args, MOMENTS)):
        check_one_line(rc, err, command, moment=moment)
    if command == "export":
        assert not any((tmp_path / str(i) / "out").exists() for i in range(len(MOMENTS)))


@pytest.mark.parametrize("command", ["train", "sft", "export"])
def test_sigterm_in_the_first_seconds_is_one_line(model, tmp_path, command):
    """Python's default for SIGTERM is to die with no word (status -15) wherever it lands."""
    args = [command_args(command, model, tmp_path / str(i)) for i in range(2)]
    for moment, (rc, err) in zip((0.3, 1.5), interrupt_at(args, (0.3, 1.5), sig=signal.SIGTERM, wait_for_handler_s=3.0)):
        check_one_line(rc, err, command, signal.SIGTERM, moment)
