"""Writes the disk refused: a full disk (ENOSPC) or a file past the process's size limit (EFBIG, `ulimit -f`),
recognised whatever raised them (Python's OSError, or safetensors' Rust error, which carries only the text
"(os error 28)"), so a command can end in one line that says what was kept."""

from __future__ import annotations

import errno

# errno -> how the refusal reads, and what the user does about it
REFUSALS = {
    errno.ENOSPC: ("no space left on the disk of {out}", "free space"),
    errno.EFBIG: ("a file in {out} went past the file-size limit (ulimit -f)", "raise the limit"),
}
_TEXT = {errno.ENOSPC: ("os error 28", "No space left"), errno.EFBIG: ("os error 27", "File too large")}


def refused_write(e: BaseException) -> int | None:
    """ENOSPC or EFBIG when `e` is the disk refusing a write (e or what it was raised from); else None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in REFUSALS:
            return e.errno
        text = str(e)
        for code, marks in _TEXT.items():
            if any(m in text for m in marks):
                return code
        e = e.__cause__ or e.__context__
    return None


def refusal_text(code: int, output_dir) -> tuple[str, str]:
    """(what happened, naming the folder; what to do first) for a code refused_write gave."""
    what, fix = REFUSALS[code]
    return what.format(out=output_dir), fix
