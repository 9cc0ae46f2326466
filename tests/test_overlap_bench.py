"""Issue 32 §3's micro-benchmark on the CPU: a smoke run of its CPU path (the question is for a GPU)."""

import json

from qerl.bench import overlap


def test_overlap_bench_times_each_side_alone_in_series_and_together(tmp_path):
    js = tmp_path / "o.json"
    rc = overlap.main(["--shape", "tiny", "--device", "cpu", "--batch", "4", "--prompt-len", "8", "--new-tokens", "8",
                       "--micro-batch", "2", "--completion-len", "8", "--micro", "1", "--json", str(js), "--record",
                       "--results-dir", str(tmp_path / "res")])
    assert rc == 0
    res = json.loads(js.read_text())
    assert res["decode_s"] > 0 and res["update_s"] > 0 and res["series_s"] > 0
    assert res["ideal_speedup"] == res["series_s"] / max(res["decode_s"], res["update_s"])
    t = res["modes"]["threads"]
    assert set(res["modes"]) == {"threads"}  # streams, priorities, green contexts: a GPU's
    assert t["wall_s"] >= max(t["decode_s"], t["update_s"]) * 0.99 and t["speedup"] == res["series_s"] / t["wall_s"]
    rows = [json.loads(x) for x in (tmp_path / "res" / "overlap.jsonl").read_text().splitlines()]
    assert {r["metric"] for r in rows} == {"decode_time", "update_time", "series_time", "ideal_speedup",
                                           "speedup_over_series"}
