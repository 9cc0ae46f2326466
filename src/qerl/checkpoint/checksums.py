"""SHA-256 of every file of a checkpoint, written at save and verified before a resume.

A truncated file fails to parse, but bytes flipped in place (a bad disk, a partial copy onto an
existing file) parse fine and resume silently with wrong values: 64 flipped bytes in a LoRA tensor
resumed with a weight of 3048. `checksums.json` lists each file's size and digest; a folder without
it (written before checksums existed) is not checked.
"""

from __future__ import annotations

import hashlib
import json
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


def verify_checksums(folder) -> bool:
    """Check every recorded file; False when the folder has no checksums (not checked). Raises
    ChecksumError naming the first file that is missing, of another size, or of other bytes."""
    folder = Path(folder)
    f = folder / NAME
    if not f.exists():
        return False
    try:
        table = json.loads(f.read_text())["files"]
        items = [(name, int(e["bytes"]), str(e["sha256"])) for name, e in table.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ChecksumError(f"{f}: unreadable ({type(e).__name__}: {e})"[:300]) from None
    for name, size, digest in items:
        p = folder / name
        if not p.is_file():
            raise ChecksumError(f"{p}: missing (listed in {NAME})")
        if p.stat().st_size != size:
            raise ChecksumError(f"{p}: {p.stat().st_size} bytes, {size} were written")
        if _digest(p) != digest:
            raise ChecksumError(f"{p}: its bytes changed since the save (SHA-256 differs from {NAME})")
    return True
