"""Environment and services in one line (issue 60): a stray WORLD_SIZE names the torchrun variables it lacks
and the fix (was `error: 'RANK'`); an unreachable MLflow server names the server and the fix at once (was four
minutes of retries, then a five-deep traceback). No network: a closed local port."""

import socket
import time

import pytest

TORCHRUN = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_torchrun(monkeypatch):
    for v in TORCHRUN:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def test_a_stray_world_size_names_what_is_missing_and_the_fix(no_torchrun):
    from qerl.train.distributed import Dist, world_size

    assert world_size() == 1
    no_torchrun.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError) as e:
        Dist.from_env("cpu")  # was KeyError('RANK'): `qerl train: error: 'RANK'`
    msg = str(e.value)
    assert "WORLD_SIZE=2" in msg and "RANK, MASTER_ADDR, MASTER_PORT are not" in msg
    assert "torchrun --nproc_per_node 2" in msg and "unset WORLD_SIZE" in msg and "\n" not in msg
    no_torchrun.setenv("RANK", "0")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT are not"):
        world_size()
    no_torchrun.setenv("MASTER_ADDR", "127.0.0.1")
    no_torchrun.setenv("MASTER_PORT", "29500")
    assert world_size() == 2
    no_torchrun.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK='2' must be a whole number >= 0 below WORLD_SIZE=2"):
        world_size()


@pytest.mark.parametrize("value", ["two", "0"])
def test_a_world_size_that_is_no_count_is_named(no_torchrun, value):
    from qerl.train.distributed import world_size

    no_torchrun.setenv("WORLD_SIZE", value)
    with pytest.raises(ValueError, match=f"WORLD_SIZE='{value}'"):
        world_size()


def test_one_process_world_size_needs_nothing_else(no_torchrun):
    from qerl.train.distributed import Dist

    no_torchrun.setenv("WORLD_SIZE", "1")
    assert Dist.from_env("cpu").world == 1


def test_qerl_trl_reads_the_world_size_by_the_same_rule(no_torchrun, tmp_path):
    from qerl.trl import GRPOConfig, GRPOTrainer
    from tiny_models import save_tiny, tiny_tokenizer

    save_tiny(tmp_path / "model", "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    no_torchrun.setenv("WORLD_SIZE", "4")
    args = GRPOConfig(output_dir=str(tmp_path / "r"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      report_to="none")
    with pytest.raises(ValueError, match="WORLD_SIZE=4 is set but RANK"):
        GRPOTrainer(model=str(tmp_path / "model"), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                    args=args, train_dataset=[{"prompt": "1+1="}])


def test_the_cli_says_a_stray_world_size_in_one_line(no_torchrun, tmp_path, capsys):
    from qerl.cli import main

    no_torchrun.setenv("WORLD_SIZE", "2")
    code = main(["sft", "--max_steps", "1", "--output_dir", str(tmp_path / "r"), "--device", "cpu",
                 "--report_to", "none"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    (line,) = [x for x in err.splitlines() if "WORLD_SIZE" in x]
    assert "error: environment variable WORLD_SIZE=2 is set but RANK" in line


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def test_an_unreachable_mlflow_server_is_one_line_naming_it(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from qerl.train.trackers import MLflow

    uri = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for v in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as e:
        MLflow(tmp_path, {"lr": 1}, "run")
    assert time.monotonic() - t0 < 10  # was ~4 minutes of mlflow's retries
    msg = str(e.value)
    assert uri in msg and "MLFLOW_TRACKING_URI" in msg and "mlflow server" in msg and "report_to" in msg
    assert "\n" not in msg and e.value.__cause__ is None and e.value.__suppress_context__


def test_an_unreachable_mlflow_server_stops_a_run_in_one_line(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from qerl.train.metrics import MetricsLog

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    for v in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(ConnectionError, match="no mlflow server answers at http://127.0.0.1:"):
        MetricsLog(tmp_path / "run", report_to="mlflow")


def test_a_local_mlflow_store_needs_no_server(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from qerl.train.trackers import MLflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    t = MLflow(tmp_path, {"lr": 1}, "run")
    t.log({"loss": 1.0}, 1)
    t.close()
    assert (tmp_path / "mlruns").is_dir()
