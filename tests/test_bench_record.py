"""Benchmark figures go where the user runs the bench (or --results_dir), never into the package's tree."""

import json

from qerl.bench import record as rec


def test_record_defaults_to_the_current_directory_not_the_source_tree(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = sorted((rec.ROOT / "benchmarks" / "results").glob("*.jsonl")) if (rec.ROOT / "benchmarks").is_dir() else []
    sizes = {p: p.stat().st_size for p in before}
    rec.record("unit_test_bench", "case", "metric", 1.5, "s", "<=2", device="cpu", command="x")
    rows = [json.loads(x) for x in (tmp_path / "benchmarks" / "results" / "unit_test_bench.jsonl").read_text().splitlines()]
    assert [(r["value"], r["met"]) for r in rows] == [(1.5, True)]
    assert not (rec.ROOT / "benchmarks" / "results" / "unit_test_bench.jsonl").exists()
    assert {p: p.stat().st_size for p in before} == sizes



def _tree(root, text="x = 1\n"):
    (root / "src" / "qerl").mkdir(parents=True, exist_ok=True)
    (root / "src" / "qerl" / "mod.py").write_text(text)


def _git(root, *args):
    import subprocess

    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                   capture_output=True)


def test_a_copy_without_git_names_its_source_by_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(rec, "ROOT", tmp_path)
    _tree(tmp_path)
    first = rec.commit()
    assert first.startswith("src-") and first == rec.commit()
    _tree(tmp_path, "x = 2\n")
    assert rec.commit() != first  # the digest follows the bytes that run


def test_the_stamp_names_a_commit_only_while_the_tree_matches_it(tmp_path, monkeypatch):
    monkeypatch.setattr(rec, "ROOT", tmp_path)
    _tree(tmp_path)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "c")
    head = rec._git("rev-parse", "--short", "HEAD")
    assert rec.commit() == head
    _tree(tmp_path, "x = 3\n")  # uncommitted source ran
    assert rec.commit() == f"{head}+src-{rec.source_digest()}"
    import pytest

    with pytest.raises(SystemExit, match="uncommitted"):
        rec.write_stamp()
    _git(tmp_path, "checkout", "--", "src")
    assert rec.write_stamp()["commit"] == head
    # the device machine gets the tree without .git
    import shutil

    shutil.rmtree(tmp_path / ".git")
    assert rec.commit() == head
    _tree(tmp_path, "x = 4\n")  # edited after the stamp: the stamp no longer speaks for it
    assert rec.commit() == f"src-{rec.source_digest()}"


def test_projections_never_sit_with_measurements_as_met(tmp_path):
    rec.record("b", "7b step projection", "peak", 20.0, "GiB", "<=24", device="CPU x86_64 (2 cores)", command="x",
               results_dir=tmp_path)
    rec.record("b", "7b step", "peak", 21.0, "GiB", "<=24", device="NVIDIA H100", command="x", results_dir=tmp_path,
               mode="repeatable")
    text = rec.render(tmp_path, out=tmp_path / "README.md")
    measured = text.split("## Figures with a target")[1].split("## Projections")[0]
    projected = text.split("## Projections")[1].split("## All figures")[0]
    assert "7b step |" in measured and "projection" not in measured
    assert "| repeatable | NVIDIA H100 |" in measured
    line = next(x for x in projected.splitlines() if "7b step projection" in x)
    assert "| (projection) |" in line and "| yes |" not in line


def test_every_row_of_the_record_names_its_commit():
    rows = [(p.name, i, json.loads(line)) for p in sorted((rec.ROOT / "benchmarks" / "results").glob("*.jsonl"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if line.strip()]
    assert rows
    assert [f"{name}:{i}" for name, i, r in rows if not r.get("commit") or r["commit"] == "unknown"] == []
