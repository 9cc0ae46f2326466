"""Evaluation: pass@1 over k samples and its standard error, from the trainer and `qerl eval`."""

import json
import statistics

import torch

from qerl.model import random_policy
from qerl.rl.evaluate import evaluate
from qerl.rollout import Engine
from qerl.tasks import get_task
from test_cli import qerl
from test_trainer import _trainer
from tiny_models import config, save_tiny, tiny_tokenizer


def odd_sevens(completions, **_):
    """A deterministic 'verifier' of the text, so correctness varies across samples."""
    return [float(c.count("7") % 2 == 1) for c in completions]


odd_sevens.metric = "accuracy"


def _engine():
    torch.manual_seed(0)
    pol = random_policy(config("qwen2"), "nvfp4", lora_rank=4, device="cpu", dtype=torch.float32, std=0.05, progress=False)
    pol.tokenizer = tiny_tokenizer()
    return Engine(pol.model, pol.tokenizer, max_len=96, max_slots=32), pol.tokenizer


def test_pass_at_1_and_stderr_match_an_independent_computation():
    eng, tok = _engine()
    rows = get_task("arithmetic", size=1, eval_size=12).eval
    rep = evaluate(eng, tok, rows, odd_sevens, samples=4, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=3,
                   progress=False, chunk=5)
    assert rep.problems == 12 and rep.samples == 4 and len(rep.per_problem) == 12
    for p in rep.per_problem:  # re-score the stored completions with the verifier itself
        assert len(p["completions"]) == 4 and p["scores"] == odd_sevens(p["completions"])
    rates = [sum(odd_sevens(p["completions"])) / 4 for p in rep.per_problem]
    assert abs(rep.pass_at_1 - statistics.mean(rates)) < 1e-12
    assert abs(rep.stderr - statistics.stdev(rates) / 12 ** 0.5) < 1e-12
    assert 0 < rep.pass_at_1 < 1  # both outcomes occur, so the test can tell rates apart
    again = evaluate(eng, tok, rows, odd_sevens, samples=4, temperature=1.0, top_p=1.0, max_new_tokens=24, seed=3,
                     progress=False, chunk=5)
    assert [p["completions"] for p in again.per_problem] == [p["completions"] for p in rep.per_problem]


def test_trainer_evaluates_before_during_and_after(tmp_path):
    tr = _trainer(tmp_path, reward_funcs=(odd_sevens,), max_steps=2, eval_on_start=True, eval_steps=1,
                  eval_on_end=True, eval_limit=6, eval_num_samples=2)
    tr.train()
    assert [e["step"] for e in tr.evals] == [0, 1, 2]  # the end's evaluation is not repeated
    for s in (0, 1, 2):
        rep = json.loads((tmp_path / "eval" / f"step_{s}.json").read_text())
        assert rep["problems"] == 6 and rep["samples"] == 2
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if "eval_pass_at_1" in r]
    assert [r["step"] for r in ev] == [0, 1, 2] and all(0 <= r["eval_pass_at_1"] <= 1 for r in ev)


def test_qerl_eval_cli_writes_a_report(tmp_path):
    save_tiny(tmp_path / "m", "qwen2")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+1?", "a": str(i + 1)}) + "\n" for i in range(8)))
    out = qerl("eval", tmp_path / "m", "--dataset", data, "--dataset-config", "{question: q, answer: a, eval_size: 8}",
               "--samples", "3", "--max-new-tokens", "8", "--out", tmp_path / "r.json")
    assert "pass@1" in out.stdout
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["problems"] == 8 and rep["samples"] == 3 and rep["params"]["temperature"] == 0.6
    assert all(len(p["scores"]) == 3 for p in rep["per_problem"])
