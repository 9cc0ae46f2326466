"""SHA-256 of every file of a checkpoint, written at save and verified before a resume.

A truncated file fails to parse, but bytes flipped in place (a bad disk, a partial copy onto an
existing file) parse fine and resume silently with wrong values: 64 flipped bytes in a LoRA tensor
resumed with a weight of 3048. `checksums.json` lists each file's size and digest.

A folder without it is checked by nothing, so that is allowed only where no checksums are expected
(written before checksums existed): a checkpoint `checkpoint-N` whose run has other checkpoints
with checksums must have its own, and lists every file it holds (a deleted `checksums.json`, or one
that lists no files or leaves a file out, no longer resumes unverified).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

NAME = "checksums.json"


class ChecksumError(ValueError):
    """A file whose bytes are not those written at save; the message names it."""


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != NAME)


def write_checksums(folder) -> Path:
    """Record every file under `folder` (call it last, once all files are written)."""
    folder = Path(folder)
    table = {p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": _digest(p)}
             for p in _files(folder)}
    out = folder / NAME
    out.write_text(json.dumps({"algorithm": "sha256", "files": table}, indent=1) + "\n")
    return out


_CHECKPOINT = re.compile(r"^checkpoint-\d+$")


def expected(folder: Path) -> bool:
    """Whether `folder` must carry checksums: a run's checkpoint whose sibling checkpoints carry them."""
    if not _CHECKPOINT.match(folder.name):
        return False
    return any(p != folder and _CHECKPOINT.match(p.name) and (p / NAME).is_file()
               for p in folder.parent.glob("checkpoint-*"))


def verify_checksums(folder, required: bool | None = None, complete: bool | None = None) -> bool:
    """Check every recorded file; False when the folder has no checksums and none are required
    (not checked). required (None: `expected(folder)`): a missing checksums.json is an error.
    complete (None: when `folder` is a checkpoint-N): every file of the folder must be listed.
    Raises ChecksumError naming the first file that is missing, of another size, of other bytes, or unlisted."""
    folder = Path(folder)
    f = folder / NAME
    if required is None:
        required = expected(folder)
    if complete is None:
        complete = bool(_CHECKPOINT.match(folder.name))
    if not f.exists():
        if required:
            raise ChecksumError(f"{f}: missing, though the run's other checkpoints have theirs: its files cannot "
                                f"be verified")
        return False
    try:
        table = json.loads(f.read_text())["files"]
        items = [(name, int(e["bytes"]), str(e["sha256"])) for name, e in table.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ChecksumError(f"{f}: unreadable ({type(e).__name__}: {e})"[:300]) from None
    present = [p.relative_to(folder).as_posix() for p in _files(folder)]
    if not items and present:
        raise ChecksumError(f"{f}: lists no files, though the folder holds {len(present)} ({present[0]}, ...)")
    if complete:
        unlisted = [n for n in present if n not in table]
        if unlisted:
            raise ChecksumError(f"{folder / unlisted[0]}: not listed in {NAME} (written after the save, or the "
                                f"list was edited): cannot be verified")
    for name, size, digest in items:
        p = folder / name
        if not p.is_file():
            raise ChecksumError(f"{p}: missing (listed in {NAME})")
        if p.stat().st_size != size:
            raise ChecksumError(f"{p}: {p.stat().st_size} bytes, {size} were written")
        if _digest(p) != digest:
            raise ChecksumError(f"{p}: its bytes changed since the save (SHA-256 differs from {NAME})")
    return True
