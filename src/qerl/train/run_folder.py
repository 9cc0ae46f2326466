"""Claiming a run folder: one run per folder, one process at a time, nothing of a run lost.

- A lock file (`.qerl.lock`: pid, host, start time) keeps a second process out; a lock whose
  process is gone (same host, `os.kill(pid, 0)` fails) is stale and taken over.
- A folder that holds an earlier run is refused unless the caller resumes it or asks to
  overwrite it (`overwrite_output_dir`, TRL's name): mixing two runs made `save_total_limit`
  delete the new run's checkpoints and a later resume load the old run's.
- Temporary folders and files of a save killed midway are removed (under the lock, so never
  those of a live save).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import time
from pathlib import Path

from ..checkpoint.atomic import recover_all
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


def refuse_or_clear(folder, overwrite: bool) -> None:
    """A fresh run's folder: refuse one that holds an earlier run, or (overwrite) delete that run."""
    found = earlier_run(folder)
    if not found:
        return
    if not overwrite:
        # the hint as the user can paste it (.venv/bin/qerl, python -m qerl)
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        raise RunFolderError(f"{folder} already holds a run ({shown}); continue it with `{qerl_command()} train --resume "
                             f"{folder}`"
                             f", start afresh there with --overwrite_output_dir (deletes that run), or choose "
                             f"another --output_dir")
    for n in found + ["config.yaml"]:
        p = Path(folder) / n
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    print(f"qerl: overwrite_output_dir: deleted the earlier run in {folder} ({', '.join(found)})")
