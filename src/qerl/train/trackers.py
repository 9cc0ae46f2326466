"""report_to's trackers, each through its own library (installed as an extra: pip install 'qerl[wandb]').

Every tracker takes each metrics row's numbers at the row's step (the step axis of metrics.jsonl) and
works with no network: TensorBoard writes output_dir/tensorboard; wandb runs offline unless WANDB_MODE
says otherwise or an API key is set (WANDB_API_KEY), writing output_dir/wandb (`wandb sync` uploads it);
trackio writes its local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio show` opens it);
mlflow writes a file store, output_dir/mlruns, unless MLFLOW_TRACKING_URI names another.
The project is TRL's default ("huggingface", or WANDB_PROJECT / TRACKIO_PROJECT / MLFLOW_EXPERIMENT_NAME);
the run's name is the output folder's.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from pathlib import Path
from typing import Protocol

PROJECT = "huggingface"  # transformers' default project (wandb, trackio) and experiment (mlflow)


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(row: dict) -> dict[str, float]:
    """The row's finite numbers, without its step (the axis)."""
    return {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, numbers.Number)
            and not isinstance(v, bool) and math.isfinite(float(v))}


class TensorBoard:
    def __init__(self, out: Path, config: dict, name: str):
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(out / "tensorboard"))

    def log(self, metrics, step):
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self):
        self.w.close()


class Wandb:
    def __init__(self, out: Path, config: dict, name: str):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=name, config=config,
                              dir=str(out), mode=mode, reinit="create_new")
        if mode == "offline":
            print(f"qerl: wandb offline run in {self.run.dir} (upload: wandb sync {Path(self.run.dir).parent})",
                  flush=True)

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def close(self):
        self.run.finish()


class Trackio:
    def __init__(self, out: Path, config: dict, name: str):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=name, config=config,
                                embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def close(self):
        self.run.finish()


class MLflow:
    def __init__(self, out: Path, config: dict, name: str):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (out / "mlruns").resolve().as_uri()
            # mlflow >= 3.7 refuses a file store unless asked: this one is what qerl chose, offline and
            # with no database package needed (mlflow-skinny)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        exp = self.client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(exp_name)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        from mlflow.entities import Param

        # mlflow limits a parameter's value to 6000 characters (a long reward_weights list, say)
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in config.items()])

    def log(self, metrics, step):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # the file store keeps a metric as a file under its name's folders: qerl's rewards/<fn> cannot sit
        # beside TRL's rewards/<fn>/mean there, and is left out (the same value)
        keep = [k for k in metrics if not any(o.startswith(k + "/") for o in metrics)]
        self.client.log_batch(self.run_id, metrics=[Metric(k, metrics[k], now, step) for k in keep])

    def close(self):
        self.client.set_terminated(self.run_id)


KINDS = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio, "mlflow": MLflow}


def open_trackers(names: list[str], out: Path, config: dict, name: str) -> list[Tracker]:
    """The named trackers (train/config.py `trackers` checked the names), started for this run."""
    return [KINDS[n](Path(out), config, name) for n in names]
