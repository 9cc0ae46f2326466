"""Issue 34, tracebacks and unclear errors, and a new user's first hour: each case through the CLI's
entry point. A clear error is exit status 2 and one line naming the field, flag, file or row, with
no traceback, before any model loads where the input alone shows it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_models import save_tiny, tiny_tokenizer

from qerl.cli import main

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "m"
    save_tiny(d, "llama")
    tiny_tokenizer().save_pretrained(d)
    return d


def train_args(model, out, *extra):
    return ["train", "--model", model, "--dataset_name", "arithmetic", "--dataset_config", "{size: 16, eval_size: 4}",
            "--max_steps", "2", "--generation_batch_size", "4", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--max_completion_length", "4", "--max_prompt_length", "64",
            "--aqn_stages", "2", "--save_steps", "1", "--save_total_limit", "2", "--report_to", "none",
            "--parity_check_steps", "0", "--optim", "adamw_torch", "--eval_on_start", "true", "--eval_on_end", "true",
            "--output_dir", out, *extra]


def one_line(err: str) -> bool:
    return len([x for x in err.splitlines() if x.strip()]) == 1


# ---- tracebacks before ------------------------------------------------------------------------------
def test_a_lone_surrogate_in_a_jsonl_names_file_line_and_field(cli, tmp_path, model, no_model_load):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    rows[3]["question"] = "What is \ud800?"
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, _, err = cli("eval", model, "--dataset", data, "--split", "train")
    assert rc == 2 and "d.jsonl line 4" in err and "'question'" in err and "surrogate" in err and one_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_train_on_cuda_without_a_gpu_is_refused_before_loading(cli, tmp_path, model, no_model_load):
    rc, _, err = cli(*train_args(model, tmp_path / "run"), "--device", "cuda")
    assert rc == 2 and "'device'" in err and "CUDA is not available" in err and one_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_float16_on_the_cpu_is_refused_before_loading(cli, tmp_path, model, no_model_load):
    rc, _, err = cli(*train_args(model, tmp_path / "run"), "--dtype", "float16")
    assert rc == 2 and "'dtype'" in err and "float16 is not supported on the CPU" in err


@pytest.mark.parametrize("command", ["generate", "train", "export"])
def test_a_llama_config_relabelled_falcon_is_named(cli, tmp_path, model, command, no_model_load):
    import shutil

    bad = tmp_path / "f"
    shutil.copytree(model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(model_type="falcon", architectures=["FalconForCausalLM"])
    (bad / "config.json").write_text(json.dumps(cfg))
    args = {"generate": ["generate", bad, "--prompt", "hi", "--device", "cpu"],
            "train": train_args(bad, tmp_path / "run"), "export": ["export", bad, tmp_path / "out"]}[command]
    rc, _, err = cli(*args)
    assert rc == 2 and "config.json: unsupported architecture ['FalconForCausalLM']" in err and one_line(err)


def test_a_model_type_that_contradicts_the_config_is_named(cli, tmp_path, model, no_model_load):
    import shutil

    bad = tmp_path / "f"
    shutil.copytree(model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "falcon"}))
    rc, _, err = cli("generate", bad, "--prompt", "hi", "--device", "cpu")
    assert rc == 2 and "transformers cannot read it as a 'falcon' config" in err and one_line(err)


def test_api_rows_without_a_prompt_past_row_0_name_the_row(tmp_path):
    from qerl.model import random_policy
    from qerl.rl import GRPOConfig, GRPOTrainer
    from tiny_models import config

    pol = random_policy(config("llama"), "nvfp4", lora_rank=2, device="cpu", dtype=torch.float32, progress=False)
    pol.tokenizer = tiny_tokenizer()
    rows = [{"prompt": "1+1?", "answer": "2"}] * 3 + [{"question": "2+2?", "answer": "4"}]
    with pytest.raises(ValueError, match=r"train_dataset row 3: no 'prompt'"):
        GRPOTrainer(GRPOConfig(output_dir=str(tmp_path / "r"), report_to="none"), policy=pol, train_dataset=rows,
                    reward_funcs=[lambda completions, **_: [0.0] * len(completions)], progress=False)


def test_a_full_disk_at_a_save_is_one_line_saying_what_is_kept(cli, tmp_path, model, monkeypatch):
    from safetensors import SafetensorError

    import qerl.rl.state as state

    real = state.save_file
    calls = []

    def fill(tensors, path, *a, **k):
        calls.append(path)
        if len(calls) > 3:  # checkpoint-1 whole (trainable, optimizer, rng), then the disk is full
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, *a, **k)

    monkeypatch.setattr(state, "save_file", fill)
    run = tmp_path / "run"
    rc, _, err = cli(*train_args(model, run, "--eval_on_start", "false", "--eval_on_end", "false"))
    last = err.strip().splitlines()[-1]  # after the load's and the bar's progress lines
    assert rc == 2 and last.startswith("qerl train: error: no space left on the disk")
    assert f"saved: {run / 'checkpoint-1'}" in last and f"qerl train --resume {run}" in last
    assert [p.name for p in run.iterdir() if p.name.startswith("checkpoint")] == ["checkpoint-1"]


# ---- unclear before ----------------------------------------------------------------------------------
def test_a_dataset_path_that_is_a_folder_says_so(cli, tmp_path, model, no_model_load):
    (tmp_path / "data.jsonl").mkdir()
    rc, _, err = cli("eval", model, "--dataset", tmp_path / "data.jsonl")
    assert rc == 2 and "is a folder" in err and "no such file" not in err


def test_an_output_dir_that_is_a_file_fails_before_loading(cli, tmp_path, model, no_model_load):
    (tmp_path / "out").write_text("x")
    for out in (tmp_path / "out", tmp_path / "out" / "run"):
        rc, _, err = cli(*train_args(model, out))
        assert rc == 2 and "'output_dir'" in err and "a file" in err and one_line(err)


def test_eval_out_a_folder_fails_before_loading_and_leaves_nothing(cli, tmp_path, model, no_model_load):
    (tmp_path / "w").mkdir()
    rc, _, err = cli("eval", model, "--dataset", "arithmetic", "--limit", "1", "--out", tmp_path / "w")
    assert rc == 2 and "is a folder" in err and sorted(p.name for p in tmp_path.iterdir()) == ["w"]


def test_a_locked_run_folder_is_refused_before_loading(cli, tmp_path, model, no_model_load):
    import socket

    run = tmp_path / "run"
    run.mkdir()
    (run / ".qerl.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": 0}))
    rc, _, err = cli(*train_args(model, run))
    assert rc == 2 and "another qerl run is using this folder" in err


def test_eval_temperature_zero_is_greedy_and_the_run_finishes_with_its_adapter(cli, tmp_path, model):
    run = tmp_path / "run"
    rc, out, err = cli(*train_args(model, run, "--eval_temperature", "0"))
    assert rc == 0, err
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    rep = json.loads((run / "eval" / "step_2.json").read_text())
    assert rep["params"]["greedy"] is True


# ---- the first hour --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished(model, tmp_path_factory):
    """A finished 2-step run with its start and end evaluations, run once through the CLI."""
    run = tmp_path_factory.mktemp("f") / "run"
    assert main([str(a) for a in train_args(model, run, "--logging_steps", "1")]) == 0
    return run


def test_resuming_a_finished_run_says_so_without_loading(finished, cli, no_model_load):
    before = (finished / "metrics.jsonl").read_text()
    rc, out, _ = cli("train", "--resume", finished)
    assert rc == 0 and "is finished (step 2/2)" in out and f"qerl eval {finished}" in out
    assert "| before | 0 |" in out and "| after | 2 |" in out  # the run's own summary
    assert (finished / "metrics.jsonl").read_text() == before  # nothing re-evaluated


def test_the_summary_after_a_resume_has_the_before_row(model, tmp_path, cli):
    run = tmp_path / "run"
    assert cli(*train_args(model, run, "--max_steps", "1", "--eval_on_end", "false"))[0] == 0
    rc, out, err = cli("train", "--resume", run, "--max_steps", "2", "--eval_on_end", "true")
    assert rc == 0, err
    assert "| before | 0 |" in out and "| after | 2 |" in out and "| change |" in out


def test_eval_of_a_run_folder_uses_its_adapter_and_task_settings(finished, cli):
    rc, out, err = cli("eval", finished, "--out", finished.parent / "rep.json")
    assert rc == 0, err
    rep = json.loads((finished.parent / "rep.json").read_text())
    mine = json.loads((finished / "eval" / "step_2.json").read_text())
    # the run's own final evaluation: same problems, samples, settings and adapter -> same score
    assert (rep["dataset"], rep["problems"], rep["samples"]) == (mine["dataset"], mine["problems"], mine["samples"])
    assert rep["params"]["adapter"] == str(finished / "adapter") and rep["params"]["temperature"] == 0.6
    assert [p["completions"] for p in rep["per_problem"]] == [p["completions"] for p in mine["per_problem"]]


def test_the_start_evaluation_is_its_own_phase_and_logging_steps_print_with_the_bar(model, tmp_path, cli):
    rc, out, err = cli(*train_args(model, tmp_path / "run", "--logging_steps", "1"))
    assert rc == 0
    # the evaluation before training runs before the train bar exists (its time is not step 1's)
    assert err.index("eval arithmetic: 4 problems") < err.index("train:")
    assert err.rindex("eval arithmetic: 4 problems") > err.rindex("train:")  # so does the final one, after the bar
    assert [x.split()[0] for x in out.splitlines() if x.startswith("step=")] == ["step=0", "step=1"]


def test_eval_help_shows_defaults(cli):
    rc, out, _ = cli("eval", "--help")
    assert rc == 0
    import re

    entries = re.split(r"\n  (?=-)", out.split("options:", 1)[1])
    for flag, default in (("--temperature", "0.6"), ("--top_p", "0.95"), ("--max_completion_length", "512"),
                          ("--dataset_name", "gsm8k-offline"), ("--samples", "1"), ("--quant", "auto")):
        (entry,) = [e for e in entries if e.startswith((flag + " ", flag + ","))]
        assert f"(default: {default})" in " ".join(entry.split()), flag
    assert "qerl eval runs/default" in out


def test_torchrun_says_how_many_ranks(model, tmp_path):
    """Two gloo ranks on the CPU: rank 0 says the rank count once."""
    port = 29500 + os.getpid() % 1000
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={port}", "-m",
           "qerl", *map(str, train_args(model, tmp_path / "run", "--eval_on_start", "false", "--eval_on_end", "false",
                                        "--max_steps", "1", "--per_device_train_batch_size", "2"))]
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("qerl train: 2 ranks (gloo)") == 1


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_end_with_one_line_and_the_resume_command(model, tmp_path, sig):
    run = tmp_path / "run"
    args = train_args(model, run, "--max_steps", "100000", "--eval_on_start", "false", "--eval_on_end", "false",
                      "--save_steps", "2")
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "qerl", *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.monotonic() + 300  # a loaded 2-core machine takes minutes to import, load and train 2 steps
    # any checkpoint: at tens of steps a second checkpoint-2 is already rotated out between two polls
    while not any(run.glob("checkpoint-*")) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.2)
    os.killpg(p.pid, sig)  # as a terminal's Ctrl-C: the whole process group
    out, err = p.communicate(timeout=120)
    assert any(run.glob("checkpoint-*")), f"no checkpoint within 300 s: {err[-2000:]}"
    assert p.returncode == (130 if sig == signal.SIGINT else 143), err[-2000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    name = "SIGINT" if sig == signal.SIGINT else "SIGTERM"
    assert last.startswith(f"qerl train: stopped by {name} at step") and f"qerl train --resume {run}" in last
    assert "saved: " + str(run / "checkpoint-") in last
