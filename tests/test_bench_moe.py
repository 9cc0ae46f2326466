"""CPU smoke runs of two GPU benches: `qerl bench moe` (one MoE expert layer's paths, rows that scripts/plot_moe.py
draws into benchmarks/moe_expert_layer.png) and `qerl bench rollout --multiturn` (tool turns against single-turn)."""

import json
import subprocess
import sys
from pathlib import Path

from qerl.bench import moe, rollout

ROOT = Path(__file__).resolve().parents[1]


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_moe_bench_records_each_path_against_the_loop_and_plot_moe_draws_them(tmp_path, capsys):
    rc = moe.main(["--experts", "4", "--hidden", "64", "--inter", "32", "--top-k", "2", "--batches", "1,8",
                   "--dtype", "float32", "--record", "--results-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "loop µs" in out and "|d| gemv" in out
    rows = _rows(tmp_path / "moe.jsonl")
    cases = {f"nvfp4 experts 4x(64x64, 64x32) top-2 T={t}" for t in (1, 8)}
    metrics = ("loop_us", "grouped_us", "gemv_us")
    assert {(r["case"], r["metric"]) for r in rows} == {(c, m) for c in cases for m in metrics}
    assert all(r["value"] > 0 and r["unit"] == "µs" for r in rows)
    assert rows[0]["command"].startswith("python -m qerl.bench.moe --experts 4")
    assert str(tmp_path) not in rows[0]["command"]  # where the rows went is no part of the case
    png = tmp_path / "moe.png"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "plot_moe.py"), "--results", str(tmp_path / "moe.jsonl"),
                    "--out", str(png)], check=True, capture_output=True)
    assert png.stat().st_size > 0


def test_multiturn_rollout_bench_records_idle_and_active_against_single_turn(tmp_path):
    rollout.main(["--multiturn", "--model", "tiny", "--batches", "2", "--prompt-len", "8", "--new-tokens", "16",
                  "--out", str(tmp_path / "out"), "--record", "--results-dir", str(tmp_path)])
    got = {r["metric"]: r for r in _rows(tmp_path / "rollout.jsonl")}
    assert set(got) == {"single_model_tokens_per_s", "idle_model_tokens_per_s", "active_model_tokens_per_s",
                        "idle_over_single", "active_over_single"}
    assert got["idle_over_single"]["case"] == "tiny nvfp4 multi-turn batch 2 prompt 8 new 16"
    assert got["idle_over_single"]["target"] == ">=0.95" and got["active_over_single"]["target"] is None
    res = json.loads((tmp_path / "out" / "bench_rollout_multiturn.json").read_text())
    assert set(res["2"]) == {"single", "idle", "active"}
