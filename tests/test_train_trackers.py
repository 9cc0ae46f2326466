"""report_to (issue 41): a real 2-step run logs to each tracker through the tracker's own library, offline,
and what the tracker stored, read back with that library (or its file format), equals metrics.jsonl."""

import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest


KEYS = ("reward", "rewards/reward_len/mean", "completions/mean_length", "learning_rate", "num_tokens")



RUN = textwrap.dedent('''
    from qerl.trl import GRPOConfig, GRPOTrainer

    def reward_len(completions, **kwargs):
        return [-abs(5 - len(c)) / 5 for c in completions]

    args = GRPOConfig(output_dir=OUT, max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-3, report_to=REPORT_TO, save_strategy="no",
                      parity_check_steps=0, dynamic_sampling=False, run_name="run")
    trainer = GRPOTrainer(model=MODEL, reward_funcs=reward_len, args=args,
                          train_dataset=[{"prompt": f"{a}+{a}="} for a in range(4)], progress=False)
    trainer.train()
''')


def train(tmp_path, model_dir, report_to) -> tuple[Path, list[dict]]:
    out = tmp_path / "run"
    env = {"OUT": str(out), "MODEL": str(model_dir), "REPORT_TO": report_to}
    exec(compile(RUN, "run.py", "exec"), env)  # noqa: S102
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return out, rows


def expected(rows):
    """{key: {step: value}} of metrics.jsonl, the values every tracker must hold."""
    return {k: {r["step"]: r[k] for r in rows if r.get(k) is not None} for k in KEYS}


def check(got: dict, rows: list[dict]) -> None:
    want = expected(rows)
    for k, by_step in want.items():
        assert by_step and set(got[k]) == set(by_step), (k, got.get(k), by_step)
        for s, v in by_step.items():
            assert math.isclose(got[k][s], v, rel_tol=1e-6, abs_tol=1e-6), (k, s, got[k][s], v)


def test_tensorboard(tmp_path, model_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, rows = train(tmp_path, model_dir, "tensorboard")
    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    check({k: {e.step: e.value for e in ea.Scalars(k)} for k in KEYS}, rows)


def wandb_history(path: Path) -> dict:
    """The history records of an offline run's .wandb file (wandb's record log: 32 KiB blocks of
    [crc32, length, kind] chunks holding protobuf Records; kind 1 whole, 2/3/4 first/middle/last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, hist = 7, 32768, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf = data[pos + 7:pos + 7 + n] if kind in (1, 2) else buf + data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                for it in rec.history.item:
                    key = it.key or "/".join(it.nested_key)
                    hist.setdefault(key, {})[rec.history.step.num] = json.loads(it.value_json)
    return hist


def test_wandb_offline(tmp_path, model_dir, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    out, rows = train(tmp_path, model_dir, "wandb")
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    check(wandb_history(files[0]), rows)


def test_wandb_dir_is_honoured(tmp_path, model_dir, monkeypatch):
    """WANDB_DIR puts the wandb run where the user asked (it went under output_dir whatever it said)."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    out, rows = train(tmp_path, model_dir, "wandb")
    files = list((tmp_path / "elsewhere" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and not (out / "wandb").exists()
    check(wandb_history(files[0]), rows)


def test_mlflow_file_store(tmp_path, model_dir, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    from mlflow.tracking import MlflowClient

    out, rows = train(tmp_path, model_dir, "mlflow")
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("huggingface")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["max_steps"] == "2"  # the config, beside the metrics
    check({k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)} for k in KEYS}, rows)


def test_trackio_local_store(tmp_path, model_dir):
    pytest.importorskip("trackio")
    # trackio fixes its store's folder at import: a fresh process with TRACKIO_DIR set
    code = "import json, sys\n" + RUN + textwrap.dedent('''
        from trackio.sqlite_storage import SQLiteStorage
        print("LOGS=" + json.dumps(SQLiteStorage.get_logs("huggingface", "run"), default=str))
    ''')
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": os.pathsep.join(sys.path)}
    script = f"OUT, MODEL, REPORT_TO = {str(tmp_path / 'run')!r}, {str(model_dir)!r}, 'trackio'\n" + code
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    logs = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("LOGS="))[5:])
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    check({k: {d["step"]: d[k] for d in logs if k in d} for k in KEYS}, rows)
    assert (tmp_path / "trackio").is_dir()  # the local store, not the user's cache


def test_trl_names_of_the_rollout_correction_and_the_clip_regions(tmp_path, model_dir):
    """What TRL logs only with vLLM on a GPU (sampling/importance_sampling_ratio/*), and the clip ratios:
    read from the update's own weights and clip masks, consistent with qerl's names of the same values."""
    from qerl.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "r"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-3, report_to="none", save_strategy="no",
                      parity_check_steps=0, dynamic_sampling=False, num_iterations=2,
                      vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
                      vllm_importance_sampling_clip_max=2.0)
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                     args=args, train_dataset=[{"prompt": f"{a}="} for a in range(4)], progress=False)
    tr.train()
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "sampling/importance_sampling_ratio/min" in r]
    assert logged  # max_steps counts optimizer steps (TRL): 2 with num_iterations 2 is one rollout round
    for m in logged:
        lo, mean, hi = (m[f"sampling/importance_sampling_ratio/{k}"] for k in ("min", "mean", "max"))
        assert 0 < lo <= mean <= hi <= 2.0 and mean == m["is_weight_mean"]
        assert m["clip_ratio/region_mean"] == m["clip_fraction"]
        assert m["clip_ratio/low_min"] <= m["clip_ratio/low_mean"] and m["clip_ratio/high_mean"] <= m["clip_ratio/high_max"]
        assert m["clip_ratio/region_mean"] == pytest.approx(m["clip_ratio/low_mean"] + m["clip_ratio/high_mean"])
        assert m["sampling/sampling_logp_difference/mean"] == m["logprob_mismatch_mean"]
