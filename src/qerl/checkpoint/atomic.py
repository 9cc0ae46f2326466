"""Atomic I/O: the one owner of "write to a temporary name, then swap" and of sharded safetensors.

Every writer of qerl (adapters, compressed-tensors checkpoints, merged exports, training
checkpoints, the metrics rewrite, the SmolLM2 cache) goes through here, so they share one failure
behaviour: at any instant the target is either its complete previous content or its complete new
content, and nothing else is left beside it once `recover` has run.

Temporaries live beside their target (same filesystem, so rename is atomic):
  .<name>.qerl-tmp-<pid>-<random>   the new content being written
  .<name>.qerl-old-<pid>-<random>   the previous folder, moved aside during a folder swap
A name too long for that within the folder's NAME_MAX is shortened there to its start, `~` and 8 hex of its
SHA-1 (`_stem`), the same in every function here. A target that is a symbolic link is written through: what
it points to gets the new content, and the link stays.
A file is replaced in one rename. A folder cannot be (rename onto a non-empty folder fails), so its
swap is two renames: previous -> aside, new -> target. A SIGKILL between the two leaves no target and
an aside copy: `recover(target)` puts it back. Every save calls `recover` on its target first, and a
run folder's start calls `recover_all` on the folder (train/run_folder.py).

`recover` leaves alone the temporaries of another live process on this host (two ranks converting
the SmolLM2 cache at once both finish; the second swap wins), so only a dead writer's are undone.

SIGTERM while a temporary exists unwinds like Ctrl-C (`sigterm_unwinds`): Python's default would end the
process on the spot, with no word, leaving the temporary; instead `Terminated` is raised, the temporary
is removed (the target keeps its previous content), and, uncaught, the process exits 143 (128 + 15).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import signal
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

TMP, OLD = ".qerl-tmp-", ".qerl-old-"
SHARD_BYTES = 4 << 30

# Test hook: called with the stage name at each step of a save, so fault-injection tests can raise
# or SIGKILL exactly there: "writing" (after each tensor a safetensors file receives), "written"
# (the temporary is complete), "aside" (a folder's previous content moved aside), "committed" (the
# new content in place, before the previous is deleted). None in normal use.
fault_hook: Callable[[str], None] | None = None


def _stage(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)


class Terminated(SystemExit):
    """SIGTERM arrived (`sigterm_unwinds`). A SystemExit: `except Exception` does not swallow it, cleanup in
    `finally` / `except BaseException` runs, and uncaught it ends the process with status 143 and no
    traceback. A command that reports it says so in one line (qerl export)."""

    signal_name = "SIGTERM"

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


def _raise_terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the cleanup ends it at once
    raise Terminated()


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Inside the block, SIGTERM raises `Terminated` where it lands (in the main thread) instead of ending the
    process there. Only where SIGTERM has Python's default action: a handler someone installed (qerl train's,
    which raises KeyboardInterrupt) or SIG_IGN is theirs to keep, and another thread cannot take signals."""
    try:
        mine = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        if mine:
            signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # an interpreter without signals here
        mine = False
    try:
        yield
    finally:
        if mine and signal.getsignal(signal.SIGTERM) in (_raise_terminated, signal.SIG_DFL):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


# What a temporary's name adds to its target's: "." + kind + pid (7 digits: Linux's largest pid_max) + "-" + 8 hex
_TEMP_EXTRA = 1 + len(TMP) + 7 + 1 + 8
assert len(TMP) == len(OLD)


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _stem(target: Path) -> str:
    """The target's part of its temporaries' names: the name itself, or, where the name and the rest of a
    temporary's name pass the folder's NAME_MAX, `{start of the name}~{sha1 of the name, 8 hex}` cut to exactly the
    room there is (so a stem of that length is always a shortened one, and recover_all can tell)."""
    room = _name_max(target.parent) - _TEMP_EXTRA
    raw = os.fsencode(target.name)
    if len(raw) < room:
        return target.name
    tag = hashlib.sha1(raw).hexdigest()[:8]
    head = raw[:room - 9]
    while head:  # never half a character
        try:
            text = head.decode()
            break
        except UnicodeDecodeError:
            head = head[:-1]
    else:
        text = ""
    return text + "~" * (room - 8 - len(head)) + tag


def _shortened(stem: str, folder: Path) -> bool:
    return len(os.fsencode(stem)) >= _name_max(folder) - _TEMP_EXTRA


def _temp_name(target: Path, kind: str) -> Path:
    return target.with_name(f".{_stem(target)}{kind}{os.getpid()}-{secrets.token_hex(4)}")


def _through_link(path) -> Path:
    """Where a save of `path` writes: a symbolic link is written through (its target gets the new content,
    the link stays), as `cp` and `>` do; anything else is the path itself."""
    path = Path(path)
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def _writer_alive(temp: Path, kind: str) -> bool:
    """Whether the process named in a temporary's name is another live process (its save goes on)."""
    try:
        pid = int(temp.name.rsplit(kind, 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return False  # our own: a save of ours that failed before it could clean up
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _fsync_dir(folder: Path) -> None:
    """Make a rename inside `folder` durable (a power loss must not undo it)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # platforms without directory handles
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    paths = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for p in paths:
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    if root.is_dir():
        for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            _fsync_dir(d)


def recover(target) -> list[str]:
    """Undo what an interrupted save of `target` left: put a moved-aside previous folder back when
    the target is missing, and delete every other temporary. Returns the names it touched."""
    target = Path(target)
    parent = target.parent
    if not parent.is_dir():
        return []
    prefix = f".{_stem(target)}"
    tmps = [p for p in parent.iterdir() if p.name.startswith(prefix + TMP) and not _writer_alive(p, TMP)]
    olds = sorted((p for p in parent.iterdir() if p.name.startswith(prefix + OLD) and not _writer_alive(p, OLD)),
                  key=lambda p: p.stat().st_mtime)
    touched = [p.name for p in tmps + olds]
    if olds and not os.path.lexists(target):
        os.replace(olds.pop(), target)  # killed between the two renames of a folder swap
        _fsync_dir(parent)
    for p in tmps + olds:
        _remove(p)
    return touched


def recover_all(folder) -> list[str]:
    """`recover` for every target in `folder` that has temporaries beside it. A temporary of a long name
    carries a shortened stem (`_stem`): its target is the entry of the folder with that stem; where none is
    left (killed between a folder swap's two renames), a dead writer's new-content temporary is removed and
    the previous content kept aside, for the next save of that target to put back (`recover`, which knows
    the full name)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stems = set()
    for p in folder.iterdir():
        for kind in (TMP, OLD):
            if p.name.startswith(".") and kind in p.name:
                stems.add(p.name[1:p.name.index(kind)])
    names = {_stem(p): p.name for p in folder.iterdir() if _shortened(_stem(p), folder)}
    touched = []
    for stem in sorted(stems):
        if stem in names or not _shortened(stem, folder):
            touched += recover(folder / names.get(stem, stem))
            continue
        for p in folder.iterdir():
            if p.name.startswith(f".{stem}{TMP}") and not _writer_alive(p, TMP):
                _remove(p)
                touched.append(p.name)
    return touched


def atomic_file(path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` writes the new content to a temporary path; it then replaces `path` in one rename.
    On any exception `path` is untouched and the temporary removed."""
    given = path
    path = _through_link(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    tmp = _temp_name(path, TMP)
    with sigterm_unwinds():
        try:
            write(tmp)
            _fsync_tree(tmp)
            _stage("written")
            os.replace(tmp, path)
        finally:
            _remove(tmp)  # gone already after a successful rename
    _fsync_dir(path.parent)
    _stage("committed")
    return Path(given)


def atomic_text(path, text: str) -> Path:
    return atomic_file(path, lambda tmp: tmp.write_text(text))


@contextlib.contextmanager
def atomic_folder(path, keep_existing: bool = False) -> Iterator[Path]:
    """`with atomic_folder(out) as tmp:` write the new folder's files into `tmp`; on a clean exit it
    replaces `out` (previous content moved aside, new renamed in, previous deleted). On an exception
    inside the block or during the swap, `out` keeps its previous content and no temporary remains.
    keep_existing: files of the previous folder that the new one does not write are carried over
    (a PEFT adapter saved into a folder that also holds a README).
    A symbolic link `out` is written through: the folder it points to is swapped, the link stays."""
    out = _through_link(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover(out)
    with sigterm_unwinds():  # SIGTERM while the temporary exists: removed below, like Ctrl-C's
        tmp = _temp_name(out, TMP)
        tmp.mkdir()
        aside = None
        try:
            yield tmp
            if keep_existing and out.is_dir():
                for p in out.iterdir():
                    if not os.path.lexists(tmp / p.name):
                        (shutil.copytree if p.is_dir() else shutil.copy2)(p, tmp / p.name)
            _fsync_tree(tmp)
            _stage("written")
            if os.path.lexists(out):
                aside = _temp_name(out, OLD)
                os.replace(out, aside)
                _stage("aside")
            os.replace(tmp, out)
        except BaseException:
            if aside is not None and not os.path.lexists(out):
                os.replace(aside, out)  # roll back: the previous folder is the target again
            _remove(tmp)
            raise
    _fsync_dir(out.parent)
    _stage("committed")
    if aside is not None:
        _remove(aside)


# ---- safetensors, written tensor by tensor ------------------------------------------------------
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


@dataclass
class TensorEntry:
    """One tensor of a safetensors file, produced only when its bytes are written (`make`), so
    peak memory is one tensor however large the checkpoint is."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "TensorEntry":
        return cls(name, tuple(t.shape), t.dtype, lambda: t)


def entries(tensors: dict[str, torch.Tensor]) -> list[TensorEntry]:
    return [TensorEntry.of(k, t) for k, t in tensors.items()]


def write_safetensors(path, items: Iterable[TensorEntry], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file (the format's header, then each tensor's bytes in order), fsynced.
    Write it inside an atomic_folder / atomic_file temporary: on its own it is not atomic."""
    # widest dtypes first (stable): every tensor's offset stays aligned to its element size
    items = sorted(items, key=lambda e: -torch.empty((), dtype=e.dtype).element_size())
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for e in items:
        if e.dtype not in _ST_DTYPES:
            raise TypeError(f"safetensors: tensor {e.name!r} has dtype {e.dtype}, which safetensors cannot hold")
        header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for e in items:
            t = e.make()
            if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                raise RuntimeError(f"safetensors: {e.name} came out {t.dtype} {list(t.shape)}, expected {e.dtype} {list(e.shape)}")
            if t.numel():
                f.write(memoryview(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()))
            del t
            _stage("writing")
        f.flush()
        os.fsync(f.fileno())


def plan_shards(items: list[TensorEntry], max_bytes: int = SHARD_BYTES) -> list[list[TensorEntry]]:
    """Consecutive groups of at most max_bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for e in items:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def write_sharded(folder, items: list[TensorEntry], max_bytes: int = SHARD_BYTES, stem: str = "model") -> list[str]:
    """Hugging Face's layout in `folder` (an atomic_folder temporary): `model.safetensors`, or
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. Returns the file names."""
    folder = Path(folder)
    shards = plan_shards(items, max_bytes)
    if len(shards) == 1:
        write_safetensors(folder / f"{stem}.safetensors", shards[0])
        return [f"{stem}.safetensors"]
    weight_map, names = {}, []
    for i, shard in enumerate(shards):
        fname = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / fname, shard)
        weight_map.update(dict.fromkeys((e.name for e in shard), fname))
        names.append(fname)
    index = {"metadata": {"total_size": sum(e.nbytes for e in items)}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return names + [f"{stem}.safetensors.index.json"]
