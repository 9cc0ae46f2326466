"""Checking rows handed in directly (a Python list, an eval_dataset) before any generation:
a row without a usable `prompt`, or without a column the rewards read, is an error naming
the row, where it used to be a KeyError in the middle of a run."""

from __future__ import annotations


def check_rows(rows, where: str = "dataset") -> list[dict]:
    rows = list(rows)
    if not rows:
        raise ValueError(f"{where}: no rows")
    columns = None
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise ValueError(f"{where} row {i}: expected a dict with a 'prompt', got {type(r).__name__}")
        p = r.get("prompt")
        if p is None:
            raise ValueError(f"{where} row {i}: no 'prompt' (columns: {', '.join(sorted(map(str, r))) or 'none'})")
        if not _is_prompt(p):
            raise ValueError(f"{where} row {i}: 'prompt' must be a non-empty string or a list of "
                             f"{{'role', 'content'}} messages, got {p!r:.80}")
        if columns is None:
            columns = set(r)
        elif missing := columns - set(r):  # reward columns are read for every row
            raise ValueError(f"{where} row {i}: missing column(s) {sorted(missing)} that row 0 has")
    return rows


def _is_prompt(p) -> bool:
    if isinstance(p, str):
        return bool(p.strip())
    return (isinstance(p, list) and bool(p)
            and all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in p))
