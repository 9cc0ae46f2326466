"""The study's runner (real `qerl train` runs on a tiny model) and its report's statistics."""

import json
import math
import statistics
import shutil
import subprocess
import sys

import pytest

from qerl.cli.study import record_figures
from qerl.study import ARMS, LOSSES
from qerl.study.report import T95, collect, paired, run_figures, write_report
from qerl.study.runner import finished, jobs
from tiny_models import save_tiny, tiny_tokenizer


def _fake_run(d, rewards, entropies, before, after, nll=None):
    d.mkdir(parents=True)
    (d / "adapter").mkdir()
    (d / "adapter" / "adapter_model.safetensors").write_bytes(b"x")
    rows = [{"step": 0, "eval_pass_at_1": before, "eval_stderr": 0.01}]
    for s, (r, e) in enumerate(zip(rewards, entropies)):
        rows.append({"step": s + 1, "reward_mean": r, "entropy": e, "updates": 1,
                     "rollout_entropy": (nll or entropies)[s]})
    rows.append({"step": len(rewards), "eval_pass_at_1": after, "eval_stderr": 0.02})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_run_figures_and_paired_claims(tmp_path):
    out = tmp_path / "study"
    base_r = {0: [0.1, 0.2, 0.3, 0.4], 1: [0.0, 0.1, 0.3, 0.2], 2: [0.2, 0.2, 0.3, 0.5]}
    for seed, rs in base_r.items():
        _fake_run(out / "dapo" / "bf16" / f"seed{seed}", rs, [1.0 + seed, 1, 1, 1], 0.10, 0.20)
        _fake_run(out / "dapo" / "nvfp4" / f"seed{seed}", [r + 0.1 + 0.01 * seed for r in rs], [1.5 + seed, 1, 1, 1],
                  0.10, 0.25)
    fig = run_figures(out / "dapo" / "nvfp4" / "seed1")
    assert fig["steps"] == 4 and fig["entropy_start"] == 2.5
    assert fig["reward_mean"] == pytest.approx(statistics.mean([0.11, 0.21, 0.41, 0.31]))
    assert fig["reward_late"] == pytest.approx(0.31)  # the last quarter of 4 steps: one step
    assert fig["heldout_gain"] == pytest.approx(15.0)
    res = collect(out)
    p = paired(res["dapo"]["nvfp4"], res["dapo"]["bf16"], "reward_mean")
    d = [0.1 + 0.01 * s for s in range(3)]
    assert p["n"] == 3 and p["diff"] == pytest.approx(statistics.mean(d))
    assert p["se"] == pytest.approx(statistics.stdev(d) / math.sqrt(3))
    # by hand: differences 0.10, 0.11, 0.12: mean 0.11, sd 0.01, s.e. 0.01 / sqrt 3 = 0.0057735; Student's t at
    # 97.5 % with 2 degrees of freedom is 4.303, so the interval's low end is 0.11 - 4.303 x 0.0057735 = 0.085157
    assert p["lo"] == pytest.approx(0.085157, abs=2e-6) and p["verdict"] == "holds"
    assert paired(res["dapo"]["bf16"], res["dapo"]["nvfp4"], "reward_mean")["verdict"] == "contradicted"
    e = paired(res["dapo"]["nvfp4"], res["dapo"]["bf16"], "entropy_start")  # +0.5 on every seed: no spread
    assert e["diff"] == pytest.approx(0.5) and e["se"] == pytest.approx(0.0, abs=1e-12)
    # held-out +5 points on every seed: no spread over seeds, but each evaluation has its own
    # sampling error (s.e. 2 points here): the interval keeps it and gives no verdict
    h = paired(res["dapo"]["nvfp4"], res["dapo"]["bf16"], "heldout_after")
    assert h["diff"] == pytest.approx(5.0) and h["se"] == pytest.approx(math.sqrt(3 * (2**2 + 2**2)) / 3)
    assert h["verdict"] == "not shown"
    text = write_report(out, tmp_path / "docs" / "study.md", "# header\n")
    assert text.startswith("# header") and "| NVFP4 LoRA | 3 |" in text and "**holds**" in text
    assert (tmp_path / "docs" / "study" / "dapo.png").stat().st_size > 10_000
    # the record: each arm's mean over seeds, each claim's difference and interval, as the report has them
    n = record_figures(res, "test device", "qerl study report", tmp_path / "results")
    rows = [json.loads(x) for x in (tmp_path / "results" / "study.jsonl").read_text().splitlines()]
    assert len(rows) == n and all(r["device"] == "test device" and r["bench"] == "study" for r in rows)
    got = {(r["case"], r["metric"]): r["value"] for r in rows}
    assert got[("dapo nvfp4 (3 seeds)", "heldout_after")] == pytest.approx(25.0)
    assert got[("dapo nvfp4 - bf16 (3 seeds)", "reward_mean_diff")] == pytest.approx(statistics.mean(d), abs=1e-4)
    assert got[("dapo nvfp4 - bf16 (3 seeds)", "reward_mean_diff_ci95_lo")] == pytest.approx(p["lo"], abs=1e-4)
    # an unfinished run (no end-of-run evaluation) is neither counted nor skipped by the runner
    d = out / "dapo" / "nf4" / "seed0"
    _fake_run(d, [0.1], [1.0], 0.1, 0.1)
    (d / "metrics.jsonl").write_text((d / "metrics.jsonl").read_text().splitlines()[1] + "\n")
    assert not finished(d) and "nf4" not in collect(out)["dapo"]


def test_the_t_table_holds_the_975_quantiles():
    """Each entry of T95 against Student's t CDF integrated here (Simpson's rule on its density): at the
    tabled value the CDF is 0.975 to the table's 3 decimals."""
    for df, t in enumerate(T95, start=1):
        c = math.gamma((df + 1) / 2) / (math.sqrt(df * math.pi) * math.gamma(df / 2))
        f = [c * (1 + (t * i / 2000) ** 2 / df) ** (-(df + 1) / 2) for i in range(2001)]
        area = t / 2000 / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))
        assert 0.5 + area == pytest.approx(0.975, abs=1e-4), (df, t)


def test_one_seed_gives_no_verdict():
    a = {0: {"m": 1.0}}
    assert paired(a, {0: {"m": 0.0}}, "m")["verdict"].startswith("not shown")


def test_the_grid_changes_one_thing_per_arm(tmp_path):
    js = list(jobs(list(LOSSES), list(ARMS), [0, 1, 2], tmp_path, ["--max_steps", "3"]))
    assert len(js) == len(LOSSES) * len(ARMS) * 3 and len({d for d, _ in js}) == len(js)
    args = {str(d.relative_to(tmp_path)): a for d, a in js}

    def opt(a, k):
        return a[a.index(f"--{k}") + 1]

    assert opt(args["dapo/nvfp4_aqn/seed1"], "quant") == "nvfp4" and opt(args["dapo/nvfp4_aqn/seed1"], "aqn") == "true"
    assert opt(args["grpo/bf16/seed0"], "loss_type") == "grpo" and opt(args["grpo/bf16/seed0"], "epsilon_high") == "null"
    assert opt(args["dapo/bf16_lr5e-6/seed2"], "learning_rate") == "5e-06"
    assert opt(args["dapo/nf4/seed2"], "learning_rate") == opt(args["dapo/bf16/seed2"], "learning_rate")
    with pytest.raises(ValueError, match="unknown arm"):
        list(jobs(["dapo"], ["fp8"], [0], tmp_path, []))


def test_study_runs_real_training_and_resumes_the_grid(tmp_path):
    save_tiny(tmp_path / "m", "qwen2")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    out = tmp_path / "study"
    cmd = [sys.executable, "-m", "qerl", "study", "run", "--losses", "dapo", "--arms", "bf16,nvfp4_aqn", "--seeds", "0",
           "--parallel", "2", "--out", str(out), "--", "--device", "cpu", "--model_name_or_path", str(tmp_path / "m"),
           "--dataset_name", "arithmetic", "--dataset_config", "{size: 24, eval_size: 8}", "--max_steps", "2",
           "--aqn_stages", "2", "--generation_batch_size", "8", "--num_generations", "4",
           "--per_device_train_batch_size", "8", "--max_completion_length", "6", "--lora_r", "4", "--eval_limit", "4",
           "--eval_num_samples", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = collect(out)
    assert set(res["dapo"]) == {"bf16", "nvfp4_aqn"}
    cfg = (out / "dapo" / "bf16" / "seed0" / "config.yaml").read_text()
    assert "quant: bf16" in cfg and "aqn: false" in cfg
    rows = [json.loads(x) for x in (out / "summary.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["ok"] for r in rows)
    # a run stopped after its last checkpoint but before its last evaluation resumes and evaluates
    d = out / "dapo" / "nvfp4_aqn" / "seed0"
    (d / "study_done").unlink()
    shutil.rmtree(d / "adapter")
    kept = [x for x in (d / "metrics.jsonl").read_text().splitlines() if not ('"eval_pass_at_1"' in x and '"step": 2' in x)]
    (d / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    assert not finished(d)
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "1 already finished, 1 to run" in again.stdout, again.stdout[-2000:]
    assert "resuming" in (d / "stdout.log").read_text() and finished(d)
    assert set(collect(out)["dapo"]) == {"bf16", "nvfp4_aqn"}
    # as the device bundle leaves the weights behind: the runner's mark still says finished
    for f in out.rglob("*.safetensors"):
        f.unlink()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert "2 already finished, 0 to run" in again.stdout


def test_held_out_claims_pair_the_evaluations_problem_by_problem(tmp_path):
    # two arms evaluated on the same 50 problems: most problems agree (easy or hard for both), a few
    # differ; the paired floor counts only the disagreements, the independent one all the spread
    out = tmp_path / "study"
    n_p = 50
    for seed in range(3):
        for arm, shift in (("bf16", 0), ("nvfp4", 1)):
            d = out / "dapo" / arm / f"seed{seed}"
            _fake_run(d, [0.1, 0.2], [1.0, 1.0], 0.3, 0.4)
            (d / "eval").mkdir()
            for step in (0, 2):
                pp = [{"index": i, "scores": [1.0] * 4 if i < 15 else [0.0] * 4} for i in range(n_p)]
                for i in range(seed, n_p, 10):  # this arm's own disagreements
                    pp[i]["scores"] = [1.0, 0.0, 1.0, 1.0] if (shift + step + i) % 2 else [0.0, 0.0, 1.0, 0.0]
                (d / "eval" / f"step_{step}.json").write_text(json.dumps({"per_problem": pp}))
    res = collect(out)["dapo"]
    assert "problems" in res["nvfp4"][0]
    p = paired(res["nvfp4"], res["bf16"], "heldout_after")
    ses = []
    for seed in range(3):
        a = json.loads((out / "dapo" / "nvfp4" / f"seed{seed}" / "eval" / "step_2.json").read_text())["per_problem"]
        b = json.loads((out / "dapo" / "bf16" / f"seed{seed}" / "eval" / "step_2.json").read_text())["per_problem"]
        diffs = [100 * (sum(x["scores"]) - sum(y["scores"])) / 4 for x, y in zip(a, b)]
        ses.append(statistics.stdev(diffs) / math.sqrt(n_p))
    floor = math.sqrt(sum(e * e for e in ses)) / 3
    assert floor > 0 and p["se"] == pytest.approx(floor)  # the metrics' "after" agree on every seed: only the floor
    # the unpaired floor (eval_stderr 2 points per run) would be far wider
    assert p["se"] < math.sqrt(3 * (2**2 + 2**2)) / 3


def test_report_joins_grids_run_apart(tmp_path):
    """DAPO and GRPO grids run in different device calls land in different directories; the report
    reads both, and refuses a run that is finished in both (which one would count is arbitrary)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for seed in (0, 1):
        _fake_run(a / "dapo" / "bf16" / f"seed{seed}", [0.1, 0.2], [1.0, 1.0], 0.1, 0.2)
        _fake_run(b / "grpo" / "nvfp4" / f"seed{seed}", [0.3, 0.4], [2.0, 1.0], 0.1, 0.3)
    res = collect([a, b])
    assert set(res) == {"dapo", "grpo"} and set(res["grpo"]["nvfp4"]) == {0, 1}
    assert res["grpo"]["nvfp4"][1]["heldout_gain"] == pytest.approx(20.0)
    text = write_report([a, b], tmp_path / "docs" / "study.md")
    assert "## DAPO" in text and "## GRPO" in text
    _fake_run(b / "dapo" / "bf16" / "seed1", [0.5, 0.5], [1.0, 1.0], 0.1, 0.2)
    with pytest.raises(ValueError, match="dapo/bf16/seed1"):
        collect([a, b])
    with pytest.raises(FileNotFoundError, match="missing"):
        collect([a, tmp_path / "missing"])
