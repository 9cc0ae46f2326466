"""The step benchmark (qerl's trainer and TRL's on random weights) at toy size on the CPU."""

import argparse
import json

import pytest
import torch

from qerl.bench import step as bstep
from qerl.bench.synthetic import random_prompts, synthetic_tokenizer, synthetic_verifier

TINY = ["--shape", "tiny", "--device", "cpu", "--prompts", "2", "--num-generations", "4", "--prompt-len", "12",
        "--max-new-tokens", "10", "--micro-batch", "4", "--optim", "adamw_torch"]


def step_parser():
    """The arguments `qerl bench step` runs a case with (shared by the MoE shape tests)."""
    ap = argparse.ArgumentParser()
    bstep.add_shape_args(ap)
    ap.add_argument("--quant", default="nvfp4")
    ap.add_argument("--logprob-chunk", type=int, default=None)
    ap.add_argument("--kv-cache-gb", type=float, default=None)
    ap.add_argument("--optim", default="adamw_8bit")
    return ap


def _args(extra=()):
    return step_parser().parse_args(TINY + list(extra))


def test_synthetic_tokenizer_decodes_every_id_and_counts_words():
    tok = synthetic_tokenizer(300)
    ids = list(range(2, 300))
    assert tok.decode(ids).split() == [f"t{i}" for i in ids]
    row = random_prompts(1, 37, 300, seed=3)[0]
    enc = tok(row["prompt"])["input_ids"]
    assert len(enc) == 37 and all(2 <= i < 300 for i in enc)
    assert tok.decode(enc) == row["prompt"]
    assert random_prompts(2, 5, 300, seed=1) == random_prompts(2, 5, 300, seed=1) != random_prompts(2, 5, 300, seed=2)


def test_synthetic_verifier_is_the_parity_of_the_last_id():
    tok = synthetic_tokenizer(100)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, 100, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (40,), generator=g)]
    got = synthetic_verifier([tok.decode(s) for s in seqs])
    assert got == [float(s[-1] % 2 == 0) for s in seqs]
    assert 0 < sum(got) < len(got)
    assert synthetic_verifier(["", "no numbers", [{"role": "assistant", "content": "t4"}]]) == [0.0, 0.0, 1.0]


def test_step_runs_the_trainer_and_updates_the_adapter(tmp_path):
    a = _args(["--out", str(tmp_path)])
    pol, build_s = bstep.build_policy(a)
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters() if p.requires_grad}
    res = bstep.run_case(a, pol, build_s)
    assert res["fits"], res
    assert res["rows"] == 8 and 0 < res["new_tokens"] <= 8 * 10
    assert res["rollout_s"] > 0 and res["update_s"] > 0
    assert res["rollout_s"] + res["logprob_s"] + res["update_s"] <= res["step_s"] * 1.001
    assert res["optim"] == "adamw_torch" and res["kv_slots"] >= 8
    changed = [n for n, p in pol.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    # the warm-up and the timed steps each made one update: every adapter moved
    assert len(changed) == len(before)
    # two timed steps (the default): the first, which compiles the update at the timed lengths, is
    # reported apart and the figures are the later step's
    assert len(res["steps"]) == 2 and res["steady_steps"] == 1 and "steady" in res["case"]
    assert res["first_step_s"] == res["steps"][0]["step_s"] and res["step_s"] == res["steps"][1]["step_s"]
    assert res["update_s"] == res["steps"][1]["update_s"]


def test_lever_sweep_and_records(tmp_path):
    out = tmp_path / "res"
    rc = bstep.main(TINY + ["--out", str(tmp_path), "--sweep-levers", "--record", "--results-dir", str(out),
                            "--json", str(tmp_path / "sweep.json")])
    assert rc == 0
    results = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["lever"] for r in results] == ["as given", *bstep.LEVERS]
    assert all(r["fits"] for r in results)
    by = {r["lever"]: r for r in results}
    assert "mb2" in by["micro-batch 2"]["case"] and "no-ckpt" in by["no-ckpt"]["case"]
    assert by["KV for a quarter of the rows"]["kv_slots"] == 2  # 8 rows: they roll out two at a time
    rows = [json.loads(x) for x in (out / "step.jsonl").read_text().splitlines()]
    keys = {"bench", "case", "metric", "value", "unit", "target", "met", "device", "date", "command", "commit"}
    assert all(keys <= set(r) for r in rows)
    assert {r["metric"] for r in rows} >= {"step_time", "rollout_time", "update_time", "rollout_tokens_per_s"}


def test_compare_records_the_speedup(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"case": "A", "fits": True, "step_s": 2.0}))
    b.write_text(json.dumps({"case": "B", "fits": True, "step_s": 5.0}))
    out = tmp_path / "res"
    assert bstep.main(["--compare", str(a), str(b), "--target", ">=1.8", "--record", "--results-dir", str(out)]) == 0
    row = json.loads((out / "step.jsonl").read_text())
    assert row["value"] == pytest.approx(2.5) and row["met"] is True and row["metric"] == "speedup_step"
    b.write_text(json.dumps({"case": "B", "fits": False}))
    assert bstep.compare(str(a), str(b), None, "step_s", "x", None) is None


def test_trl_baseline_runs_the_same_step(tmp_path):
    pytest.importorskip("trl")
    from qerl.bench import trl_step

    js = tmp_path / "trl.json"
    assert trl_step.main(TINY + ["--out", str(tmp_path), "--json", str(js)]) == 0
    res = json.loads(js.read_text())
    assert res["fits"] and res["rows"] == 8 and len(res["steps"]) == 2
    # the timer wraps TRL's generate: the rollout is part of the timed step
    assert 0 < res["rollout_s"] < res["step_s"]
    assert 0 < res["new_tokens"] <= 8 * 10
    assert res["optim"] == "adamw_torch"


def test_cli_routes_bench_step(tmp_path, capsys):
    from qerl.cli import main

    assert main(["bench", "step", *TINY, "--out", str(tmp_path), "--steps", "1"]) == 0
    assert "rollout" in capsys.readouterr().out


def test_scaling_refuses_files_that_are_not_one_case(tmp_path):
    from qerl.bench import scaling

    def case(name, world, step_s):
        f = tmp_path / f"{name}{world}.json"
        suffix = f" dp{world}" if world > 1 else ""
        f.write_text(json.dumps({"case": name + suffix, "world_size": world, "fits": True, "step_s": step_s,
                                 "rollout_s": 1.0, "update_s": 1.0, "step_tokens_per_s": 10.0, "device": "x"}))
        return str(f)

    rows = scaling.scaling(scaling.load([case("a", 8, 2.0), case("a", 1, 12.0)]))
    # by hand: 12 s on one GPU, 2 s on 8: 6x faster; 6x of the 8x that 8 GPUs could give is 75 %
    assert [r["gpus"] for r in rows] == [1, 8] and rows[1]["speedup"] == pytest.approx(6.0)
    assert rows[1]["efficiency"] == pytest.approx(0.75) and rows[0]["speedup"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="different cases"):
        scaling.load([case("a", 1, 1.0), case("b", 2, 1.0)])
    with pytest.raises(ValueError, match="same GPU count"):
        scaling.load([case("a", 1, 1.0), case("a", 1, 2.0)])
