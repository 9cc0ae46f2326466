"""Claiming a run folder: one run per folder, one process at a time, nothing of a run lost.

- A lock file (`.qerl.lock`: pid, host, start time) keeps a second process out; a lock whose
  process is gone (same host, `os.kill(pid, 0)` fails) is stale and taken over.
- A folder that holds an earlier run is refused unless the caller resumes it or asks to
  overwrite it (`overwrite_output_dir`, TRL's name): mixing two runs made `save_total_limit`
  delete the new run's checkpoints and a later resume load the old run's.
- Temporary folders and files of a save killed midway are removed (under the lock, so never
  those of a live save).
- A folder is never cleared while it is, holds or lies inside one of the new run's own inputs (its
  model, adapter, data files): `qerl train --model R/adapter --output_dir R --overwrite_output_dir`
  deleted the run it trained from (check_clear, the one guard of every clearing command).
- The run's record: config.yaml (every field, paths absolute: train/paths.py) and, for a run of a
  `trl grpo --config` file, run_record.json (its reward functions by import path and the folder each
  was imported from). `--resume` continues on exactly that; a changed value that defines the run
  (IDENTITY) is refused by name unless the command line allows it (`--allow_changed FIELD`), and any
  other changed value is said in one line (check_resume).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoint.atomic import recover_all
from ..checkpoint.guard import own_input
from ..checkpoint.run_files import LOCK, earlier_run
from ..invocation import qerl_command
_TEMP_PREFIXES = (".checkpoint-", ".old-checkpoint-")  # temporary names of saves before checkpoint/atomic.py


class RunFolderError(ValueError):  # the CLI reports ValueErrors as clear errors, no traceback
    pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    """An exclusive lock on `folder`, held by this process until `release()` (or exit)."""

    def __init__(self, folder):
        self.path = Path(folder) / LOCK
        self.me = {"pid": os.getpid(), "host": socket.gethostname()}
        self.held = False

    def acquire(self) -> None:
        if self.held:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a stale lock removed, then try again
            if self._create():
                self.held = True
                atexit.register(self.release)
                return
            holder = self._read()
            if not self._stale(holder):
                raise self.busy(holder)
            print(f"qerl: removing the stale lock {self.path} of a process that is gone ({holder})")
            self._remove_if(holder)
        raise RunFolderError(f"{self.path}: could not take the lock (it keeps changing: another run is starting)")

    def busy(self, holder: dict | None) -> RunFolderError:
        who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "another process"
        return RunFolderError(f"{self.path.parent}: another qerl run is using this folder ({who}, lock file "
                              f"{self.path}); wait for it, use another output_dir, or delete the lock file "
                              f"if that process is gone")

    def _create(self) -> bool:
        """Atomically create the lock with its content (link fails if the name exists)."""
        tmp = self.path.with_name(f"{LOCK}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**self.me, "started": time.time()}))
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self) -> dict | None:
        try:
            d = json.loads(self.path.read_text())
            return d if isinstance(d, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: written by no live qerl (the content is written before the link)

    def _stale(self, holder: dict | None) -> bool:
        if holder is None:  # released meanwhile
            return True
        if not isinstance(holder.get("pid"), int) or holder.get("host") != self.me["host"]:
            # another host's process cannot be checked from here: only garbage is stale
            return not holder
        return not _alive(holder["pid"])

    def _remove_if(self, holder: dict | None) -> None:
        """Remove the lock only if it is still the one judged stale (another process may have taken it)."""
        if holder is not None and self._read() == holder:
            self.path.unlink(missing_ok=True)

    def release(self) -> None:
        d = self._read()
        if self.held and d and all(d.get(k) == v for k, v in self.me.items()):  # ours, not a successor's
            self.path.unlink(missing_ok=True)
        self.held = False


def check_unlocked(folder) -> None:
    """Refuse a folder whose lock a live process holds, without taking the lock (a check before the
    model loads; the trainer takes the lock itself)."""
    lock = RunLock(folder)
    holder = lock._read()
    if holder is not None and not lock._stale(holder):
        raise lock.busy(holder)


def clean_temporaries(folder) -> list[str]:
    """Remove what a killed save left (temporary checkpoint folders, a half-written metrics copy)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    gone = recover_all(folder)  # checkpoint/atomic.py's temporaries (a moved-aside checkpoint comes back)
    for p in folder.iterdir():
        if p.is_dir() and p.name.startswith(_TEMP_PREFIXES):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p.name)
        elif p.name == "metrics.jsonl.tmp" or (p.name.startswith(f"{LOCK}.") and p.name.endswith(".tmp")):
            p.unlink(missing_ok=True)
            gone.append(p.name)
    if gone:
        print(f"qerl: removed what an interrupted save left in {folder}: {', '.join(sorted(gone))}")
    return gone


@dataclass
class RunInput:
    """Something a run reads from disk: what it is (model, adapter, dataset, ...) and its path."""
    what: str
    path: str


def run_inputs(cfg) -> list[RunInput]:
    """The local files and folders a run of `cfg` reads: its model (an adapter folder and the base under
    it), its data files (train/paths.local_paths names them)."""
    from ..model.adapter_start import adapter_folder, base_to_load
    from . import paths

    found = []
    for name, path in paths.local_paths(cfg).items():
        if name == "output_dir":
            continue
        if name == "model_name_or_path" and adapter_folder(path) is not None:
            found.append(RunInput("adapter (model_name_or_path)", path))
            try:  # a base that cannot be read is preflight's to report
                base = base_to_load(path)
            except (OSError, ValueError):
                continue
            if paths.is_local_model(base):
                found.append(RunInput("adapter's base model", base))
            continue
        found.append(RunInput(name.replace("_name_or_path", "").replace("_name", "") + f" ({name})", path))
    return found


def check_inputs(folder, inputs: list[RunInput], command: str = "train") -> None:
    """Refuse to clear `folder` when it is, holds or lies inside one of `inputs` (links followed; the rule:
    checkpoint/guard.py own_input, shared with `qerl export` and `qerl quantize`): one line naming the input
    and the folder."""
    hit = own_input(folder, [(inp.what, inp.path) for inp in inputs])
    if hit:
        how, what, path = hit
        raise RunFolderError(f"{folder}: {how} the run's own {what} {path}; --overwrite_output_dir "
                             f"would delete the earlier run there and with it what `qerl {command}` reads: "
                             f"choose another --output_dir")


def check_clear(folder, overwrite: bool, inputs: list[RunInput] | None = None, command: str = "train") -> list[str]:
    """The one guard before a fresh run's folder is cleared: the earlier run's names it would delete; refused
    without overwrite, or when the folder is, holds or lies inside one of the run's inputs."""
    found = earlier_run(folder)
    if not found:
        return []
    if not overwrite:
        # the hint as the user can paste it (.venv/bin/qerl, python -m qerl)
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        raise RunFolderError(f"{folder} already holds a run ({shown}); continue it with `{qerl_command()} train --resume "
                             f"{folder}`"
                             f", start afresh there with --overwrite_output_dir (deletes that run), or choose "
                             f"another --output_dir")
    check_inputs(folder, inputs or [], command)
    return found


def refuse_or_clear(folder, overwrite: bool, inputs: list[RunInput] | None = None, command: str = "train") -> None:
    """A fresh run's folder: refuse one that holds an earlier run, or (overwrite) delete that run, never
    what the new run reads (check_clear)."""
    found = check_clear(folder, overwrite, inputs, command)
    if not found:
        return
    for n in found + ["config.yaml", RECORD]:
        p = Path(folder) / n
        if p.is_dir() and not p.is_symlink():  # a link is removed, not what it points to
            shutil.rmtree(p)
        elif os.path.lexists(p):
            p.unlink()
    print(f"qerl: overwrite_output_dir: deleted the earlier run in {folder} ({', '.join(found)})")


# ---- the run's record ---------------------------------------------------------------------------------
RECORD = "run_record.json"  # beside config.yaml: what a config cannot hold (a TRL config file's script arguments)
# the fields that define what a run is: a resume that changes one is refused unless allowed by name
IDENTITY = ("model_name_or_path", "quant", "modules_to_not_convert", "lm_head_4bit", "embed_4bit", "lora_r",
            "lora_alpha", "lora_target_modules", "dataset_name", "dataset_config", "seed")
ALLOW_HELP = (f"with --resume: continue although FIELD differs from the run's record (comma-separated or "
              f"repeated). A resume continues on the record (config.yaml, run_record.json); a changed "
              f"{', '.join(IDENTITY)} (or another base model or quant) is refused unless allowed here; other "
              f"changed fields (max_steps, logging, saving, ...) are said in one line")


@dataclass
class RecordedReward:
    """A reward function of a `trl grpo --config` file: TRL's name or an import path module.function, and
    the folder its module was imported from (None for TRL's own), so a resume from anywhere imports it."""
    name: str
    root: str | None = None


@dataclass
class RunRecord:
    """What defines a run beyond its config.yaml: the script's reward functions and reward model."""
    reward_funcs: list[RecordedReward] = field(default_factory=list)
    reward_model_name_or_path: str | None = None

    def __bool__(self) -> bool:
        return bool(self.reward_funcs or self.reward_model_name_or_path)


def import_root(name: str) -> str | None:
    """The sys.path folder an imported reward module.function came from (None: TRL's own name, or not a file)."""
    import sys

    if "." not in name:
        return None
    module = name.rsplit(".", 1)[0]
    file = getattr(sys.modules.get(module), "__file__", None)
    if not file:
        return None
    root = Path(file).resolve().parent
    if Path(file).name == "__init__.py":
        root = root.parent
    for _ in module.split(".")[1:]:
        root = root.parent
    return str(root)


def record_of(names: list[str], reward_model: str | None) -> RunRecord:
    """The record of a run's script rewards, once their modules are imported (import_root)."""
    from . import paths

    if reward_model and paths.is_local_model(reward_model):
        reward_model = paths.expand(reward_model)
    return RunRecord([RecordedReward(n, import_root(n)) for n in names], reward_model)


def write_record(folder, record: RunRecord | None) -> None:
    """run_record.json for a run with script rewards; a stale one of an earlier run removed otherwise."""
    from ..checkpoint.atomic import atomic_text

    path = Path(folder) / RECORD
    if record:
        atomic_text(path, json.dumps(asdict(record), indent=1) + "\n")
    else:
        path.unlink(missing_ok=True)


def read_record(folder) -> RunRecord:
    """The run's record (an empty one when the folder has none); a file that is not one names itself."""
    path = Path(folder) / RECORD
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return RunRecord()
    except (OSError, ValueError) as e:
        raise RunFolderError(f"{path}: unreadable ({type(e).__name__}: {e}); restore it from a copy or remove it "
                             f"(the resume then runs the config's own rewards)") from None
    try:
        return RunRecord([RecordedReward(**r) for r in d.get("reward_funcs") or []], d.get("reward_model_name_or_path"))
    except (AttributeError, TypeError):
        raise RunFolderError(f"{path}: not a qerl run record (field 'reward_funcs'); restore it from a copy or remove "
                             f"it") from None


class RecordCallback:
    """A trainer callback: the run's record written beside config.yaml when training begins (the folder is
    claimed and cleared by then), by rank 0."""

    def __init__(self, names: list[str] | None = None, reward_model: str | None = None):
        self.names, self.reward_model = list(names or []), reward_model

    def on_train_begin(self, args, state, control, **kw):
        if state.is_world_process_zero:
            write_record(args.output_dir, record_of(self.names, self.reward_model) if self.names or
                         self.reward_model else None)


def allowed_fields(values: list[str] | None, cls) -> set[str]:
    """--allow_changed's fields; a name that is not a field of `cls` is refused (with the nearest)."""
    import dataclasses
    import difflib

    names = {n.strip().replace("-", "_") for v in values or [] for n in str(v).split(",") if n.strip()}
    known = {f.name for f in dataclasses.fields(cls)}
    for n in sorted(names - known):
        near = difflib.get_close_matches(n, known, n=1)
        raise ValueError(f"command line: --allow_changed {n}: not a config field" +
                         (f" (did you mean {near[0]}?)" if near else ""))
    return names


@dataclass
class Change:
    name: str
    old: object
    new: object


def check_resume(recorded, cfg, allowed: set[str], folder, command: str = "train") -> list[Change]:
    """A resume's config against the run's record: a changed IDENTITY field not in `allowed` is refused by
    name; the other changes are returned (the caller says them). Both configs normalised (train/paths.py)."""
    import dataclasses

    import shlex

    changes = [Change(f.name, getattr(recorded, f.name), getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
               if f.name != "output_dir" and getattr(recorded, f.name) != getattr(cfg, f.name)]
    src = Path(folder) / "config.yaml"
    for c in changes:
        if c.name in IDENTITY and c.name not in allowed:
            raise RunFolderError(f"--resume {folder}: {c.name} is {c.old!r} in the run's record ({src}), the command "
                                 f"line makes it {c.new!r}; a resume continues the run as it was: drop --{c.name}, "
                                 f"pass --allow_changed {c.name} to continue on the new value, or start a new run "
                                 f"(another --output_dir than {shlex.quote(str(folder))})")
    return changes


def changes_line(changes: list[Change], folder, command: str = "train") -> str | None:
    """The one line a resume says about the values it changes from the run's record (None: none)."""
    if not changes:
        return None
    shown = ", ".join(f"{c.name} {c.old!r} -> {c.new!r}" for c in changes)
    return f"qerl {command}: --resume {folder}: changed from the run's record ({Path(folder) / 'config.yaml'}): {shown}"
