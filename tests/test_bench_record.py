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

