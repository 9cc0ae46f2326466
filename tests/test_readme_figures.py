"""The README states current facts: its figures table equals the benchmark record, and it opens with the two commands.

Each row of the README's `## Figures` table names a record row (bench, case, metric, device) of
benchmarks/results/<bench>.jsonl; its value must be the NEWEST such row's value (the last in the file), rounded to
the digits the README shows, and its commit that row's commit. A run that appends a newer row for a figure the
README shows fails here until the README is brought up to date.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
MAX_LINES = 400
COLUMNS = ("figure", "value", "unit", "bench", "case", "metric", "device", "commit")
MAIN_COMMAND = "bash scripts/setup.sh && .venv/bin/qerl train"


# ---- parsing ---------------------------------------------------------------------------------------------
def _cells(line: str) -> list[str]:
    """A Markdown table row's cells (`\\|` is a literal bar), each stripped of spaces and one pair of backticks."""
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    out = []
    for p in parts:
        p = p.strip().replace("\\|", "|")
        if len(p) >= 2 and p[0] == p[-1] == "`":
            p = p[1:-1]
        out.append(p)
    return out


def figures_table(text: str) -> list[dict]:
    """The rows of the table under the `## Figures` heading, as dicts keyed by its header."""
    lines = text.splitlines()
    try:
        start = lines.index("## Figures")
    except ValueError:
        raise AssertionError("README.md has no '## Figures' heading") from None
    rows, header = [], None
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        if not line.startswith("|"):
            if header is not None:
                break  # the table ended
            continue
        cells = _cells(line)
        if header is None:
            header = cells
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue  # the separator row
        assert len(cells) == len(header), f"figures row has {len(cells)} cells, header {len(header)}: {line}"
        rows.append(dict(zip(header, cells)))
    assert header is not None, "no table under '## Figures'"
    assert tuple(header) == COLUMNS, f"figures table columns {header}, expected {COLUMNS}"
    return rows


def newest_rows(bench: str, results: Path = RESULTS) -> dict[tuple[str, str, str, str], dict]:
    """The last row of <results>/<bench>.jsonl for each (bench, case, metric, device)."""
    path = results / f"{bench}.jsonl"
    assert path.is_file(), f"no record file {path}"
    newest = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            newest[(r["bench"], r["case"], r["metric"], r.get("device"))] = r
    return newest


def as_shown(value: float, shown: str) -> str:
    """The record's value rounded to the decimals the README shows (thousands separators ignored)."""
    shown = shown.replace(",", "")
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return f"{value:.{decimals}f}"


def check_row(row: dict, records: dict[str, dict], results: Path = RESULTS) -> list[str]:
    """What is wrong with one README figures row against the record (empty: nothing)."""
    bench = row["bench"]
    if bench not in records:
        if not (results / f"{bench}.jsonl").is_file():
            return [f"{row['figure']!r}: no record file benchmarks/results/{bench}.jsonl"]
        records[bench] = newest_rows(bench, results)
    key = (bench, row["case"], row["metric"], row["device"])
    rec = records[bench].get(key)
    if rec is None:
        return [f"{row['figure']!r}: no record row {key}"]
    problems = []
    shown = row["value"].replace(",", "")
    if as_shown(float(rec["value"]), shown) != shown:
        problems.append(f"{row['figure']!r}: README {row['value']}, newest record row {rec['value']} "
                        f"(commit {rec['commit']}, {rec['date']})")
    if row["commit"] != rec["commit"]:
        problems.append(f"{row['figure']!r}: README commit {row['commit']}, newest record row's {rec['commit']}")
    if row["unit"] != (rec.get("unit") or ""):
        problems.append(f"{row['figure']!r}: README unit {row['unit']!r}, record's {rec.get('unit')!r}")
    return problems


def check_readme(text: str, results: Path = RESULTS) -> list[str]:
    """Every problem of the README's figures table against the record in `results` (empty: none)."""
    problems = []
    records: dict[str, dict] = {}
    for row in figures_table(text):
        problems += check_row(row, records, results)
    return problems


def ci_test_command() -> str:
    """The command .ci/run runs (its last line that is not a comment or shell setup)."""
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [ln for ln in lines if ln and not ln.startswith("#") and not ln.startswith(("set ", "cd "))]
    return commands[-1]


def opening_commands(text: str) -> list[str]:
    """The command lines of the README's first code block, which must open the README (after its title)."""
    lines = text.splitlines()
    body = [ln for ln in lines[1:] if ln.strip()]
    assert lines[0].startswith("# "), "README.md must start with its title"
    assert body and body[0].startswith("```"), "the two commands must come right after the title"
    start = lines.index(body[0])
    block = []
    for line in lines[start + 1:]:
        if line.startswith("```"):
            break
        block.append(line)
    return [ln.strip() for ln in block if ln.strip() and not ln.strip().startswith("#")]


# ---- the tests ----------------------------------------------------------------------------------------
def test_readme_at_most_400_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines (at most {MAX_LINES})"


def test_readme_opens_with_the_main_job_and_the_ci_test_command():
    commands = opening_commands(README.read_text())
    assert commands == [MAIN_COMMAND, ci_test_command()], commands


def test_readme_figures_equal_the_newest_record_rows():
    rows = figures_table(README.read_text())
    assert len(rows) >= 10, f"only {len(rows)} figures"
    problems = check_readme(README.read_text())
    assert not problems, "\n".join(problems)


def test_readme_figures_name_distinct_record_rows():
    rows = figures_table(README.read_text())
    keys = [(r["bench"], r["case"], r["metric"], r["device"]) for r in rows]
    assert len(keys) == len(set(keys)), "a record row is shown twice"


# ---- the check can fail (on copies of the README's text, never the file) -------------------------------
def _first_row_line(text: str) -> str:
    lines = text.splitlines()
    start = lines.index("## Figures")
    return next(ln for ln in lines[start:] if ln.startswith("| ") and not ln.startswith("| figure")
                and not ln.startswith("|---"))


def _with_cell(text: str, column: str, new: str) -> str:
    line = _first_row_line(text)
    cells = _cells(line)
    cells[COLUMNS.index(column)] = new
    return text.replace(line, "| " + " | ".join(cells) + " |", 1)


@pytest.mark.parametrize("column, change", [
    ("value", lambda v: f"{float(v) + 1:.{len(v.split('.')[1]) if '.' in v else 0}f}"),
    ("value", lambda v: v + "9" if "." in v else v + ".9"),   # a digit more than the record rounds to
    ("commit", lambda c: "0000000"),
    ("case", lambda c: c + " (no such case)"),
    ("device", lambda d: "NVIDIA H200" if "H100" in d else "NVIDIA H100 80GB HBM3"),
    ("bench", lambda b: "no_such_bench"),
])
def test_the_check_fails_on_a_changed_copy(column, change):
    text = README.read_text()
    assert not check_readme(text)
    cell = _cells(_first_row_line(text))[COLUMNS.index(column)]
    changed = _with_cell(text, column, change(cell))
    assert changed != text
    assert check_readme(changed), f"changing {column} of the first figure went unnoticed"


def test_a_newer_record_row_fails_the_check(tmp_path):
    """A row appended to the record after the README was written makes the README stale."""
    text = README.read_text()
    row = figures_table(text)[0]
    src = RESULTS / f"{row['bench']}.jsonl"
    results = tmp_path / "results"
    results.mkdir()
    lines = src.read_text().splitlines()
    newest = newest_rows(row["bench"])[(row["bench"], row["case"], row["metric"], row["device"])]
    later = dict(newest, value=float(newest["value"]) * 2 + 1, commit="abcdef0")
    (results / src.name).write_text("\n".join(lines + [json.dumps(later)]) + "\n")
    for other in RESULTS.glob("*.jsonl"):  # the other benches as they are
        if other.name != src.name:
            (results / other.name).write_text(other.read_text())
    assert not check_readme(text, RESULTS)
    problems = check_readme(text, results)
    assert any("abcdef0" in p for p in problems), problems


def test_the_opening_check_fails_on_changed_commands():
    text = README.read_text()
    first = opening_commands(text)
    assert first[1] in text
    changed = text.replace(first[1], first[1] + " -x", 1)
    assert opening_commands(changed) != [MAIN_COMMAND, ci_test_command()]
    moved = text.replace("\n```bash\n", "\nSome words first.\n\n```bash\n", 1)
    with pytest.raises(AssertionError):
        opening_commands(moved)
