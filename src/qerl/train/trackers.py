"""report_to's trackers, each through its own library (installed as an extra: pip install 'qerl[wandb]').

Every tracker takes each metrics row's numbers at the row's step, the step axis of metrics.jsonl: TRL's
global_step (optimizer steps so far, 1 after the first; train/metrics.py). Evaluation rows (TRL's eval_*
metrics under qerl.trl, qerl's eval_pass_at_1) go at the step they followed; under qerl.trl,
log_completions also gives wandb and trackio a `completions` table at each logging step (trl/completions.py).
Every tracker works with no network: TensorBoard writes output_dir/tensorboard; wandb runs offline unless
WANDB_MODE says otherwise or an API key is set (WANDB_API_KEY), writing under WANDB_DIR, else output_dir/wandb
(`wandb sync` uploads it); trackio writes its local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio;
`trackio show` opens it); mlflow writes a file store, output_dir/mlruns, unless MLFLOW_TRACKING_URI names another.
The project is TRL's default ("huggingface", or WANDB_PROJECT / TRACKIO_PROJECT / MLFLOW_EXPERIMENT_NAME).
The run's name is run_name (the config field, a config file's or a flag's, or GRPOConfig / SFTConfig(run_name=...));
unset, the output folder's name, except under qerl.trl, where each tracker names the run itself, as
transformers leaves it.

A resumed run (`resume_step`: the checkpoint's global_step) repeats the steps from there, and metrics.jsonl drops
its rows past the checkpoint: TensorBoard drops the killed run's points from that step on (purge_step); mlflow
marks the killed run KILLED and starts a new one holding the killed run's points before that step. A run
stopped by Ctrl-C ends KILLED in mlflow, FAILED on another exception. An unreachable wandb server is one line
(ConnectionError) after wandb's init_timeout, 15 s here unless WANDB_INIT_TIMEOUT says otherwise; an mlflow server
(MLFLOW_TRACKING_URI http(s)) whose port does not answer within 5 s is one line naming it, when the trackers start.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import socket
import sys
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


def ending() -> str:
    """How the run is ending, read in close(): the loop closes its trackers in a `finally`, so an exception
    on its way out is the one that ends the run (Ctrl-C and SIGTERM arrive as KeyboardInterrupt)."""
    e = sys.exc_info()[1]
    return "FINISHED" if e is None else "KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED"


class TensorBoard:
    def __init__(self, out: Path, config: dict, name: str, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops the points at and past it written before (the killed run's)
        self.w = SummaryWriter(str(out / "tensorboard"), purge_step=resume_step)

    def log(self, metrics, step):
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)
        self.w.flush()

    def close(self):
        self.w.close()


WANDB_INIT_TIMEOUT = 15.0  # seconds wandb.init waits for its server (wandb's own default, 90, then ~100 s in all)


def wandb_init_timeout() -> float:
    """WANDB_INIT_TIMEOUT where the user set it, else 15 s. Read here at each run: wandb reads its environment
    once a process (its setup singleton), so a second run in one process (a notebook, a study) kept the first
    run's timeout and waited wandb's 90 s default."""
    text = os.environ.get("WANDB_INIT_TIMEOUT", "").strip()
    if not text:
        return WANDB_INIT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"report_to wandb: WANDB_INIT_TIMEOUT={text!r} is not a positive number of seconds")
    return value


class Wandb:
    def __init__(self, out: Path, config: dict, name: str, resume_step: int | None = None):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        settings = wandb.Settings(init_timeout=wandb_init_timeout())
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=name, config=config,
                                  # WANDB_DIR, where the user set it, as transformers' WandbCallback honours it
                                  dir=os.environ.get("WANDB_DIR") or str(out), mode=mode, reinit="create_new",
                                  settings=settings)
        except wandb.errors.Error as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            fix = ("train offline with WANDB_MODE=offline (upload later with wandb sync), or leave wandb out of "
                   "report_to")
            if isinstance(e, wandb.errors.CommError):
                url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
                raise ConnectionError(f"report_to wandb: the wandb server at {url} started no run ({why}); "
                                      f"{fix}") from None
            raise ValueError(f"report_to wandb: {type(e).__name__}: {why}; {fix}") from None
        if mode == "offline":
            print(f"qerl: wandb offline run in {self.run.dir} (upload: wandb sync {Path(self.run.dir).parent})",
                  flush=True)

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def close(self):
        self.run.finish()


class Trackio:
    def __init__(self, out: Path, config: dict, name: str, resume_step: int | None = None):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=name, config=config,
                                embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def close(self):
        self.run.finish()


def mlflow_name(key: str) -> str:
    """`key` as mlflow takes a metric's name: transformers' MLflowCallback's cleaning (rewards/<lambda>/mean is
    rewards/_lambda_/mean), and no empty, '.' or '..' part between slashes (the file store's folders)."""
    key = re.sub(r"[^0-9A-Za-z_\-\.\ :/]", "_", key)
    if os.name == "nt":  # mlflow refuses a colon on Windows
        key = key.replace(":", "_")
    return "/".join("_" if p in ("", ".", "..") else p for p in key.split("/"))[:250]


MLFLOW_PROBE_S = 5.0  # seconds to wait for the tracking server's port before the run starts


def check_mlflow_server(uri: str) -> None:
    """An http(s) MLFLOW_TRACKING_URI whose server does not answer is one line naming it and the fix, at once:
    mlflow's client retried a refused connection for about 4 minutes, then gave a five-deep traceback. A proxy
    that would carry the request (HTTP(S)_PROXY, not bypassed by NO_PROXY) is left to mlflow."""
    import urllib.parse
    import urllib.request

    u = urllib.parse.urlsplit(uri)
    if u.scheme not in ("http", "https") or not u.hostname:
        return
    if urllib.request.getproxies().get(u.scheme) and not urllib.request.proxy_bypass(u.hostname):
        return
    try:
        port = u.port or (443 if u.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"report_to mlflow: MLFLOW_TRACKING_URI={uri!r} has no valid port; fix it, or unset it to "
                         "log to output_dir/mlruns") from None
    try:
        socket.create_connection((u.hostname, port), timeout=MLFLOW_PROBE_S).close()
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise ConnectionError(f"report_to mlflow: no mlflow server answers at {uri} (MLFLOW_TRACKING_URI; {why}); "
                              f"start it (mlflow server --host {u.hostname} --port {port}), point "
                              "MLFLOW_TRACKING_URI at a running one, unset it to log to output_dir/mlruns, or leave "
                              "mlflow out of report_to") from None


class MLflow:
    FOLDER_TAG = "qerl.run_folder"  # host:path of the run folder: the runs of one folder, across resumes

    def __init__(self, out: Path, config: dict, name: str, resume_step: int | None = None):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (out / "mlruns").resolve().as_uri()
            # mlflow >= 3.7 refuses a file store unless asked: this one is what qerl chose, offline and
            # with no database package needed (mlflow-skinny)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        check_mlflow_server(uri)
        from mlflow.exceptions import MlflowException

        try:
            self._start(MlflowClient(tracking_uri=uri), out, config, name, resume_step)
        except MlflowException as e:  # a server that answers but refuses: its first line, not five frames
            why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise ConnectionError(f"report_to mlflow: the mlflow tracking store at {uri} started no run ({why}); "
                                  "fix the server or MLFLOW_TRACKING_URI, unset it to log to output_dir/mlruns, or "
                                  "leave mlflow out of report_to") from None

    def _start(self, client, out: Path, config: dict, name: str, resume_step: int | None) -> None:
        self.client = client
        exp_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        exp = self.client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(exp_name)
        folder = f"{socket.gethostname()}:{Path(out).resolve()}"
        # the server picks this folder's runs (a shared server's experiment holds many); a quote in the path
        # would end mlflow's filter string, so such a path is matched here
        where = "" if "'" in folder else f"tags.`{self.FOLDER_TAG}` = '{folder}'"
        earlier = [r for r in self.client.search_runs([exp_id], where, max_results=1000,
                                                      order_by=["attributes.start_time DESC"])
                   if r.data.tags.get(self.FOLDER_TAG) == folder]
        for r in earlier:
            # the run folder's lock is ours: a run of it still RUNNING was killed (kill -9, power loss)
            if r.info.status == "RUNNING":
                self.client.set_terminated(r.info.run_id, status="KILLED")
        tags = {self.FOLDER_TAG: folder}
        if resume_step is not None and earlier:
            tags.update({"qerl.resumed_from_run": earlier[0].info.run_id, "qerl.resume_step": str(resume_step)})
        self.run_id = self.client.create_run(exp_id, run_name=name, tags=tags).info.run_id
        from mlflow.entities import Param

        # mlflow limits a parameter's value to 6000 characters (a long reward_weights list, say)
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in config.items()])
        if resume_step is not None and earlier:
            self._carry(earlier[0].info.run_id, resume_step)

    def _carry(self, old: str, resume_step: int) -> None:
        """The earlier run's points before the checkpoint's step, into this run: it holds one point a step
        from the start, as metrics.jsonl does (mlflow cannot delete points from the killed run)."""
        from mlflow.entities import Metric

        keep = [m for k in self.client.get_run(old).data.metrics
                for m in self.client.get_metric_history(old, k) if m.step < resume_step]
        for i in range(0, len(keep), 1000):  # mlflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=[Metric(m.key, m.value, m.timestamp, m.step)
                                                        for m in keep[i:i + 1000]])

    def log(self, metrics, step):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        named = {mlflow_name(k): v for k, v in metrics.items()}
        # the file store keeps a metric as a file under its name's folders: qerl's rewards/<fn> cannot sit
        # beside TRL's rewards/<fn>/mean there, and is left out (the same value)
        keep = [k for k in named if not any(o.startswith(k + "/") for o in named)]
        self.client.log_batch(self.run_id, metrics=[Metric(k, named[k], now, step) for k in keep])

    def close(self):
        self.client.set_terminated(self.run_id, status=ending())


KINDS = {"tensorboard": TensorBoard, "wandb": Wandb, "trackio": Trackio, "mlflow": MLflow}


def open_trackers(names: list[str], out: Path, config: dict, name: str,
                  resume_step: int | None = None) -> list[Tracker]:
    """The named trackers (train/config.py `trackers` checked the names), started for this run.
    resume_step: the checkpoint's step when the run resumes (its rows from there on are logged again)."""
    opened: list[Tracker] = []
    try:
        for n in names:
            opened.append(KINDS[n](Path(out), config, name, resume_step))
    except BaseException:
        for t in opened:  # one tracker refused to start: the others end too, the run does not start
            t.close()
        raise
    return opened
