"""Issue 50, trackers (items 4, 8 and 11), each against the tracker's real library, offline:
- mlflow refused `rewards/<lambda>/mean` at step 1 (a traceback, no checkpoint): names are cleaned as
  transformers' MLflowCallback cleans them;
- after kill -9 and a resume TensorBoard held two points for each re-run step, a killed mlflow run stayed
  RUNNING, a Ctrl-C'd one ended FINISHED: one point a step, the killed run KILLED, Ctrl-C KILLED;
- wandb with an API key and no server waited ~100 s for a CommError traceback: one line, in seconds."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qerl.train.trackers import open_trackers


@pytest.fixture
def mlflow_store(monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    from mlflow.tracking import MlflowClient

    def client(out: Path):
        c = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
        exp = c.get_experiment_by_name("huggingface")
        return c, c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])

    return client


def grpo(out: Path, model: Path, report_to: str, reward, max_steps=2, callbacks=None):
    from qerl.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-3, report_to=report_to, save_strategy="no",
                      parity_check_steps=0, dynamic_sampling=False)
    tr = GRPOTrainer(model=str(model), reward_funcs=reward, args=args, callbacks=callbacks,
                     train_dataset=[{"prompt": f"{a}+{a}="} for a in range(4)], progress=False)
    return tr.train()


# ---- item 4: names mlflow refuses ----------------------------------------------------------------------
def test_mlflow_takes_a_lambda_rewards_metrics(tmp_path, model_dir, mlflow_store):  # noqa: F811
    out = tmp_path / "run"
    grpo(out, model_dir, "mlflow", lambda completions, **_: [float(len(c)) for c in completions])  # died at step 1
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    want = {r["step"]: r["rewards/<lambda>/mean"] for r in rows}
    client, (run,) = mlflow_store(out)
    assert run.info.status == "FINISHED"
    got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "rewards/_lambda_/mean")}
    assert got == pytest.approx(want) and len(want) == 2


def test_every_name_mlflow_would_refuse_is_logged_under_a_clean_one(tmp_path, mlflow_store):
    names = {"rewards/<lambda>/mean": "rewards/_lambda_/mean", "a//b": "a/_/b", "/lead": "_/lead",
             "up/../x": "up/_/x", "tail/": "tail/_", "é(1)": "__1_", "ok name-1.5:x": "ok name-1.5:x"}
    out = tmp_path / "run"
    (t,) = open_trackers(["mlflow"], out, {}, "run")
    t.log({k: float(i) for i, k in enumerate(names)}, 0)
    t.close()
    client, (run,) = mlflow_store(out)
    assert run.data.metrics == {v: float(i) for i, v in enumerate(names.values())}


# ---- item 8: kill -9, Ctrl-C and resume ------------------------------------------------------------------
KILLED_RUN = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path
    from qerl.train.trackers import open_trackers

    ts = open_trackers(["tensorboard", "mlflow"], Path(sys.argv[1]), {"max_steps": 6}, "run")
    for step in range(6):
        for t in ts:
            t.log({"loss": 100.0 + step}, step)
    os.kill(os.getpid(), signal.SIGKILL)  # killed past its checkpoint at step 3
''')


def test_a_resume_after_kill_9_holds_one_point_a_step(tmp_path, mlflow_store):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", KILLED_RUN, str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == -9, p.stderr[-2000:]
    time.sleep(1.1)  # TensorBoard orders event files by their names, which start with the second they were opened
    ts = open_trackers(["tensorboard", "mlflow"], out, {"max_steps": 6}, "run", resume_step=3)
    for step in range(3, 6):  # the resumed run repeats steps 3-5, with its own values
        for t in ts:
            t.log({"loss": float(step)}, step)
    for t in ts:
        t.close()
    want = {0: 100.0, 1: 101.0, 2: 102.0, 3: 3.0, 4: 4.0, 5: 5.0}  # what metrics.jsonl holds after the resume

    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("loss")] == list(want.items())  # steps 3-5 were there twice

    client, runs = mlflow_store(out)
    assert [r.info.status for r in runs] == ["KILLED", "FINISHED"]  # the killed one stayed RUNNING
    new = runs[1]
    assert new.data.tags["qerl.resumed_from_run"] == runs[0].info.run_id and new.data.params["max_steps"] == "6"
    assert {m.step: m.value for m in client.get_metric_history(new.info.run_id, "loss")} == want
    assert len(client.get_metric_history(new.info.run_id, "loss")) == 6


def test_a_fresh_run_in_a_killed_runs_folder_ends_the_killed_run(tmp_path, mlflow_store):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", KILLED_RUN, str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == -9, p.stderr[-2000:]
    (t,) = open_trackers(["mlflow"], out, {}, "run")
    t.close()
    client, runs = mlflow_store(out)
    assert [r.info.status for r in runs] == ["KILLED", "FINISHED"]
    assert "loss" not in runs[1].data.metrics  # a fresh start carries nothing over


def test_a_live_run_of_another_folder_on_a_shared_server_is_left_running(tmp_path, mlflow_store, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = (tmp_path / "shared").resolve().as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (live,) = open_trackers(["mlflow"], tmp_path / "a" / "run", {}, "run")  # another run, same name, still going
    (t,) = open_trackers(["mlflow"], tmp_path / "b" / "run", {}, "run", resume_step=2)
    t.close()
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(live.run_id).info.status == "RUNNING"
    assert "qerl.resumed_from_run" not in client.get_run(t.run_id).data.tags  # nothing of its own to resume
    live.close()


class CtrlC:
    """Ctrl-C landing during step 1 (the loop closes its trackers in a finally, as on a real SIGINT)."""

    def __getattr__(self, name):
        return lambda *a, **k: None

    def on_step_end(self, args, state, control, **kw):
        if state.global_step >= 1:
            raise KeyboardInterrupt


def one(completions, **_):  # a named reward: names mlflow takes as they are
    return [1.0] * len(completions)


def test_ctrl_c_ends_the_mlflow_run_killed(tmp_path, model_dir, mlflow_store):  # noqa: F811
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        grpo(out, model_dir, "mlflow", one, max_steps=4, callbacks=[CtrlC()])
    _, (run,) = mlflow_store(out)
    assert run.info.status == "KILLED"  # was FINISHED


def test_an_error_ends_the_mlflow_run_failed(tmp_path, mlflow_store):
    out = tmp_path / "run"
    (t,) = open_trackers(["mlflow"], out, {}, "run")
    try:
        raise OSError(28, "No space left on device")
    except OSError:
        t.close()  # as the loop's finally does while the error passes
    _, (run,) = mlflow_store(out)
    assert run.info.status == "FAILED"


# ---- item 11: wandb with an API key and no server ----------------------------------------------------------
def test_an_unreachable_wandb_server_is_one_line_in_seconds(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # a closed port: nothing answers there
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for k in ("WANDB_MODE", "WANDB_INIT_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    t0 = time.perf_counter()
    with pytest.raises(ConnectionError) as e:  # an OSError: the CLI prints it as one line, status 2
        open_trackers(["wandb"], tmp_path / "run", {}, "run")
    took = time.perf_counter() - t0
    msg = str(e.value)
    assert "\n" not in msg and f"127.0.0.1:{port}" in msg and "WANDB_MODE=offline" in msg and "report_to" in msg
    assert took < 45, f"waited {took:.0f} s"  # ~100 s before


def test_qerl_train_with_an_unreachable_wandb_server_is_one_line_and_trains_nothing(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    from cli_runs import train_args
    from tiny_models import save_tiny, tiny_tokenizer

    from qerl.cli import main

    model = tmp_path / "m"
    save_tiny(model, "llama")
    tiny_tokenizer().save_pretrained(model)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")  # wandb's own setting, read by wandb when set
    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "run"
    t0 = time.perf_counter()
    rc = main([str(a) for a in train_args(model, out, "--report_to", "wandb")])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    # 90 s (wandb's default) when another wandb run in this process had read the environment first
    assert took < 45, f"waited {took:.0f} s: WANDB_INIT_TIMEOUT=3 not honoured"
    assert rc == 2 and "Traceback" not in err and "CommError" not in err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert line.startswith("qerl train: error: report_to wandb:") and "WANDB_MODE=offline" in line
    assert not list(out.glob("checkpoint-*")) and not (out / "adapter").exists()


@pytest.mark.parametrize("text,expected", [("", 15.0), ("3", 3.0), (" 2.5 ", 2.5), ("0", None), ("-1", None),
                                           ("nan", None), ("soon", None)])
def test_wandb_init_timeout_is_read_at_each_run(monkeypatch, text, expected):
    from qerl.train.trackers import WANDB_INIT_TIMEOUT, wandb_init_timeout

    monkeypatch.setenv("WANDB_INIT_TIMEOUT", text)
    if expected is None:
        with pytest.raises(ValueError, match="WANDB_INIT_TIMEOUT"):
            wandb_init_timeout()
    else:
        assert wandb_init_timeout() == expected
    monkeypatch.delenv("WANDB_INIT_TIMEOUT")
    assert wandb_init_timeout() == WANDB_INIT_TIMEOUT


# ---- item 13: "none" beside a tracker -------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["wandb,none", "none,tensorboard", ["tensorboard", "none"], "all,none", "auto,mlflow"])
def test_none_all_or_auto_beside_a_tracker_is_refused_naming_report_to(value):
    from qerl.rl import GRPOConfig
    from qerl.sft import SFTConfig

    names = value if isinstance(value, list) else value.split(",")
    word = next(n for n in names if n in ("none", "all", "auto"))  # the first of them is named
    for cls in (GRPOConfig, SFTConfig):
        with pytest.raises(ValueError, match=f"config field 'report_to': '{word}' stands alone"):
            cls(report_to=value)


@pytest.mark.parametrize("value", ["none", ["none"], "none,none", " none ", ""])
def test_none_alone_means_no_trackers(value):
    from qerl.sft import SFTConfig
    from qerl.train.config import trackers

    assert trackers(SFTConfig(report_to=value).report_to) == []


def test_the_command_line_refuses_wandb_none_before_loading(cli, tmp_path, model, no_model_load):
    from cli_runs import one_line, sft_args

    rc, _, err = cli(*sft_args(model, tmp_path / "run", "--report_to", "wandb,none"))
    assert rc == 2 and "'report_to'" in err and "'none' stands alone" in err and one_line(err), err
