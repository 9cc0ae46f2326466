"""Issue 32 §3's micro-benchmark on the CPU: a smoke run of its CPU path (the question is for a GPU), and its
arithmetic on work of known length."""

import json
import time

import pytest

from qerl.bench import overlap

ARGS = ["--shape", "tiny", "--device", "cpu", "--batch", "4", "--prompt-len", "8", "--new-tokens", "8",
        "--micro-batch", "2", "--completion-len", "8", "--micro", "2"]


def test_overlap_bench_times_each_side_alone_in_series_and_together(tmp_path):
    js = tmp_path / "o.json"
    rc = overlap.main(ARGS + ["--json", str(js), "--record", "--results-dir", str(tmp_path / "res")])
    assert rc == 0
    res = json.loads(js.read_text())
    assert res["decode_s"] > 0 and res["update_s"] > 0 and res["series_s"] > 0
    t = res["modes"]["threads"]
    assert set(res["modes"]) == {"threads"}  # streams, priorities, green contexts: a GPU's
    assert t["wall_s"] >= max(t["decode_s"], t["update_s"]) * 0.99  # together holds both sides
    rows = [json.loads(x) for x in (tmp_path / "res" / "overlap.jsonl").read_text().splitlines()]
    assert {r["metric"] for r in rows} == {"decode_time", "update_time", "series_time", "ideal_speedup",
                                           "speedup_over_series"}
    got = {r["metric"]: r["value"] for r in rows}
    assert got["ideal_speedup"] == res["ideal_speedup"] and got["speedup_over_series"] == t["speedup"]


def test_overlap_arithmetic_on_sleeps_of_known_length(tmp_path, monkeypatch):
    """Decode sleeps 0.3 s, the update 0.3 s a pass (--micro 2: 0.6 s); sleeps release the GIL, so on the
    decode thread they overlap the update. By hand: series 0.3 + 0.6 = 0.9 s; the ideal overlap hides the
    shorter side, 0.9 / max(0.3, 0.6) = 1.5x; together the wall is the longer side, 0.6 s, so 0.9 / 0.6 = 1.5x
    over series (run one after the other, the threads mode would give 1.0x)."""
    monkeypatch.setattr(overlap, "decode_work", lambda eng, prompts, new: time.sleep(0.3))
    monkeypatch.setattr(overlap, "update_work", lambda model, mb, passes: time.sleep(0.3 * passes))
    js = tmp_path / "o.json"
    assert overlap.main(ARGS + ["--json", str(js)]) == 0
    res = json.loads(js.read_text())
    assert res["decode_s"] == pytest.approx(0.3, abs=0.1) and res["update_s"] == pytest.approx(0.6, abs=0.1)
    assert res["series_s"] == pytest.approx(0.9, abs=0.15)
    assert res["ideal_speedup"] == pytest.approx(1.5, abs=0.2)
    t = res["modes"]["threads"]
    assert t["decode_s"] == pytest.approx(0.3, abs=0.1) and t["update_s"] == pytest.approx(0.6, abs=0.1)
    assert t["wall_s"] == pytest.approx(0.6, abs=0.15)
    assert t["speedup"] == pytest.approx(1.5, abs=0.25)
