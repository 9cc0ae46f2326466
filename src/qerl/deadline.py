"""A hard time limit for work that cannot be bounded by construction (symbolic math on model text, a
user's tool call): reward functions (qerl.tasks.rewards) and tool calls (qerl.tools.runner) run here.

Threads cannot be stopped and signal.alarm works only in the main thread, so each call runs in a
small pool of worker processes: a call past its deadline has its worker killed (and replaced) and
comes back as a failure; the caller never waits longer than the deadline.

Workers are fresh interpreters, not forks or multiprocessing children: nothing of the trainer's
threads or CUDA state is inherited, and the user's main script is never re-imported. Jobs and
results cross a pipe as JSON (nothing is unpickled).

The current folder is never on a worker's import path (`python -m` would put it first, and a
`math_verify.py` in the folder a run starts from was executed): a worker runs `python -P -c BOOT`
with this process's import path minus the current folder and the main script's folder. A module
the workers must import that this process itself loaded from one of those folders (qerl run from
its source folder, a user's tool module) has that folder appended last, after every installed package.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import subprocess
import sys
import time
from collections import deque
from multiprocessing.connection import Connection, wait

STARTUP_S = 120.0  # a fresh worker's imports (sympy, antlr) are not charged to any call's deadline


def _serve(rd: Connection, wr: Connection, warm: list[str]) -> None:
    """Worker loop: import `warm`, say ready, then run ['module:function', args] jobs until EOF."""
    import logging
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its timeouts are ours to report
    for name in warm:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    wr.send_bytes(b'"ready"')
    while True:
        try:
            target, args = json.loads(rd.recv_bytes())
        except (EOFError, OSError):
            return
        mod, _, fn = target.partition(":")
        try:
            msg = [True, getattr(importlib.import_module(mod), fn)(*args)]
        except Exception as e:  # noqa: BLE001 - reported to the caller as that job's failure
            msg = [False, f"{type(e).__name__}: {e}"[:300]]
        try:
            data = json.dumps(msg).encode()
        except (TypeError, ValueError):  # a result JSON cannot carry: that job's failure, not the worker's end
            data = json.dumps([False, f"TypeError: {target} returned a {type(msg[1]).__name__}, not JSON"]).encode()
        wr.send_bytes(data)


def _unsafe_folders() -> set[str]:
    """The folders no worker imports from first: the current one, and the main script's."""
    out = {os.path.realpath(os.getcwd())}
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if main:
        out.add(os.path.realpath(os.path.dirname(os.path.abspath(main))))
    return out


def _root_of(name: str) -> str | None:
    """The folder a loaded module's top package was imported from (None if it is not loaded from a file)."""
    top = sys.modules.get(name.partition(".")[0])
    f = getattr(top, "__file__", None)
    if not f:
        return None
    f = os.path.realpath(f)
    return os.path.dirname(os.path.dirname(f)) if os.path.basename(f) == "__init__.py" else os.path.dirname(f)


def worker_path(warm: tuple[str, ...] = ()) -> list[str]:
    """A worker's sys.path: this process's without '' and the unsafe folders (the current folder, the
    main script's), then the unsafe folders that qerl or a `warm` module was loaded from, last."""
    unsafe = _unsafe_folders()
    path = [p for p in sys.path if p and os.path.realpath(p) not in unsafe]
    for name in ("qerl", *warm):
        root = _root_of(name)
        if root and root in unsafe and root not in path:
            path.append(root)  # after site-packages: an installed module of the same name wins
    return path


# runs with -P (nothing prepended to sys.path), sets the import path, then serves
_BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[4]); from qerl.deadline import _main; "
         "_main(sys.argv[1:4])")


def _main(argv: list[str]) -> None:
    from multiprocessing.connection import Connection as C

    _serve(C(int(argv[0]), writable=False), C(int(argv[1]), readable=False), json.loads(argv[2]))


class _Worker:
    def __init__(self, warm: tuple[str, ...]):
        child_rd, parent_wr = os.pipe()  # (read end, write end)
        parent_rd, child_wr = os.pipe()
        path = worker_path(warm)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}  # site customisation sees no unsafe folder either
        env.pop("PYTHONSTARTUP", None)
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", _BOOT, str(child_rd), str(child_wr),
                                      json.dumps(list(warm)), json.dumps(path)], pass_fds=(child_rd, child_wr),
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        os.close(child_rd)
        os.close(child_wr)
        self.send, self.conn = Connection(parent_wr, readable=False), Connection(parent_rd, writable=False)
        try:
            ok = self.conn.poll(STARTUP_S) and json.loads(self.conn.recv_bytes()) == "ready"
        except (EOFError, OSError):
            ok = False
        if not ok:
            self.kill()
            raise RuntimeError(f"a reward worker process (qerl.deadline) did not start within "
                               f"{STARTUP_S:.0f} s")

    def kill(self):
        self.proc.kill()
        self.proc.wait()
        self.send.close()
        self.conn.close()


class DeadlinePool:
    """`map('pkg.module:function', [args, ...], deadline_s)` -> [(True, result) | (False, error text)],
    each job given at most `deadline_s` seconds of wall time once a worker has it."""

    def __init__(self, workers: int | None = None, warm: tuple[str, ...] = ()):
        self.n = workers or max(1, min(4, os.cpu_count() or 1))
        self.warm = tuple(warm)
        self._idle: list[_Worker] = []
        atexit.register(self.close)

    def _worker(self) -> _Worker:
        return self._idle.pop() if self._idle else _Worker(self.warm)

    def map(self, target: str, jobs: list[tuple], deadline_s: float) -> list[tuple[bool, object]]:
        out: list = [None] * len(jobs)
        todo, busy = deque(enumerate(jobs)), {}  # conn -> (worker, job index, deadline)
        try:
            while todo or busy:
                while todo and len(busy) < self.n:
                    w = self._worker()
                    i, args = todo.popleft()
                    w.send.send_bytes(json.dumps([target, list(args)]).encode())
                    busy[w.conn] = (w, i, time.monotonic() + deadline_s)
                first = min(d for _, _, d in busy.values())
                for conn in wait(list(busy), timeout=max(0.0, first - time.monotonic())):
                    w, i, _ = busy.pop(conn)
                    try:
                        out[i] = tuple(json.loads(conn.recv_bytes()))
                        self._idle.append(w)
                    except (EOFError, OSError):  # the worker died (out of memory, a crash in C)
                        out[i] = (False, "the reward worker process died")
                        w.kill()
                now = time.monotonic()
                for conn in [c for c, (_, _, d) in busy.items() if d <= now]:
                    w, i, _ = busy.pop(conn)
                    w.kill()  # the only way to stop it; a fresh worker takes its place
                    out[i] = (False, f"TimeoutError: no result within the {deadline_s:g} s limit")
        finally:
            for w, _, _ in busy.values():  # interrupted: workers mid-job cannot be reused
                w.kill()
        return out

    def close(self):
        while self._idle:
            self._idle.pop().kill()

    def __getstate__(self):  # a reward function may be pickled (workers, pipes are not)
        return {"n": self.n, "warm": self.warm}

    def __setstate__(self, st):
        self.__init__(st["n"], st["warm"])


_SHARED: dict[tuple, DeadlinePool] = {}


def shared_pool(warm: tuple[str, ...] = ()) -> DeadlinePool:
    """One pool per process and warm-up list: reward functions built per task share its workers."""
    if warm not in _SHARED:
        _SHARED[warm] = DeadlinePool(warm=warm)
    return _SHARED[warm]


if __name__ == "__main__":  # a worker started by hand: python -P -m qerl.deadline READ_FD WRITE_FD WARM_JSON
    _main(sys.argv[1:4])
