"""Task data: local files with column mappings, malformed rows, the offline GSM8K set, reasoning-gym."""

import json

import pytest

from qerl.tasks import get_task
from qerl.tasks.data import DataError, load_file
from qerl.tasks.rewards import numeric_accuracy


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_with_column_mapping(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [{"problem": f"What is {i} + 1?", "solution": f"#### {i + 1}", "id": i}
                                      for i in range(30)])
    rows = load_file(f, question="problem", answer="solution").rows
    assert len(rows) == 30 and rows[3]["question"] == "What is 3 + 1?" and rows[3]["answer"] == "#### 4"
    assert rows[3]["prompt"] == [{"role": "user", "content": "What is 3 + 1?"}] and rows[3]["id"] == 3
    t = get_task(str(f), question="problem", answer="solution", eval_size=5)
    assert len(t.eval) == 5 and len(t.train) == 25
    assert {r["question"] for r in t.eval}.isdisjoint(r["question"] for r in t.train)
    assert t.reward_funcs[0](["so 4"], [rows[3]["answer"]]) == [1.0]


def test_malformed_rows_name_the_file_and_line_or_are_skipped(tmp_path):
    f = _jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": "1"}, "{not json", {"question": "b"},
                                         {"question": "", "answer": "2"}, {"question": "c", "answer": 3}])
    with pytest.raises(DataError, match=r"bad.jsonl line 2: not valid JSON"):
        load_file(f)
    got = load_file(f, on_error="skip")
    assert [r["question"] for r in got.rows] == ["a", "c"] and got.rows[1]["answer"] == "3"
    assert got.skipped == 3 and "line 2" in got.first_problem
    g = _jsonl(tmp_path / "g.jsonl", [{"question": "a", "answer": "1"}, {"question": "b"}])
    with pytest.raises(DataError, match=r"g.jsonl line 2: missing field 'answer' \(fields: question\)"):
        load_file(g)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_file(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="unsupported file type"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_file(tmp_path / "x.csv")


def test_parquet_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": ["1+1?", "2+2?", None], "a": ["2", "4", "6"]}), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d.parquet row 2: field 'q' must be a non-empty string"):
        load_file(tmp_path / "d.parquet", question="q", answer="a")
    got = load_file(tmp_path / "d.parquet", question="q", answer="a", on_error="skip")
    assert [r["answer"] for r in got.rows] == ["2", "4"] and got.skipped == 1


def test_offline_gsm8k_test_problems():
    t = get_task("gsm8k-offline")
    assert len(t.eval) == 100 and t.train == []
    assert all("####" in r["answer"] and r["question"].strip() for r in t.eval)
    assert len({r["id_orig"] for r in t.eval}) == 100
    # the reference solutions themselves score 1 (extraction of '#### N' through the reward)
    assert numeric_accuracy([r["answer"] for r in t.eval], [r["answer"] for r in t.eval]) == [1.0] * 100
    # and a solution whose final number is changed scores 0
    wrong = [r["answer"].rsplit("####", 1)[0] + "#### 123456789" for r in t.eval]
    assert sum(numeric_accuracy(wrong, [r["answer"] for r in t.eval])) == 0


def test_reasoning_gym_task_is_seeded_and_held_out_is_unseen():
    pytest.importorskip("reasoning_gym")
    a = get_task("rg:chain_sum", size=300, eval_size=50, seed=1, min_terms=2, max_terms=3, min_digits=1, max_digits=1)
    b = get_task("reasoning_gym/chain_sum", size=300, eval_size=50, seed=1, min_terms=2, max_terms=3, min_digits=1,
                 max_digits=1)
    assert [r["question"] for r in a.train] == [r["question"] for r in b.train]
    assert {r["question"] for r in a.eval}.isdisjoint(r["question"] for r in a.train) and len(a.eval) == 50
    r = a.eval[0]
    assert a.accuracy_func()([f"<answer>{r['answer']}</answer>"], [r["answer"]], metadata=[r["metadata"]],
                             question=[r["question"]]) == [1.0]


def test_unknown_names_get_suggestions():
    with pytest.raises(ValueError, match="did you mean gsm8k"):
        get_task("gsm8kk")
    pytest.importorskip("reasoning_gym")
    with pytest.raises(ValueError, match="did you mean chain_sum"):
        get_task("rg:chain_sun")
    with pytest.raises(ValueError, match="dataset_config: unknown option 'no_such_option' for reasoning_gym dataset"):
        get_task("rg:chain_sum", no_such_option=3)
