"""Issue 22, "every bad input a clear error": one test per case, run through the CLI's entry point
as a user runs it. A clear error is exit status 2 and one line that names the field, flag, file,
row or tensor at fault, with no traceback; where the input was valid all along (a BOM, a blank
line) it now loads. Tests that a bad input fails *before* the model loads patch the loader to fail."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import save_tiny, tiny_tokenizer

from qerl.cli import main


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Qwen2 folder with its tokenizer."""
    d = tmp_path_factory.mktemp("m") / "m"
    save_tiny(d, "qwen2")
    tiny_tokenizer().save_pretrained(d)
    return d


def _jsonl(path, rows, raw=b""):
    path.write_bytes(raw + b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    return path


ROWS = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(20)]


# ---- tracebacks before ---------------------------------------------------------------------------
def test_negative_lora_rank_names_the_field(cli, tmp_path, no_model_load):
    rc, _, err = cli("train", "--lora_r", "-4", "--output_dir", tmp_path / "run")
    assert rc == 2 and "'lora_r'" in err and "-4" in err


def test_unknown_device_names_the_field_and_the_flag(cli, tmp_path, model, no_model_load):
    rc, _, err = cli("train", "--device", "tpu", "--output_dir", tmp_path / "run")
    assert rc == 2 and "'device'" in err and "'tpu'" in err
    rc, _, err = cli("generate", model, "--device", "tpu", "--prompt", "hi")
    assert rc == 2 and "--device" in err and "'tpu'" in err


@pytest.mark.parametrize("value, named", [
    ("{size: ", "--dataset_config"),                        # not YAML
    ("[1, 2]", "--dataset_config"),                         # not a mapping
    ("{sizee: 30}", "unknown option 'sizee'"),              # a misspelt key, with its suggestion below
    ("{size: abc}", "dataset_config.size: 'abc' is not an integer"),
    ("{digits: 0}", "dataset_config.digits: 0 is not an integer >= 1"),
])
def test_malformed_dataset_config_names_the_key(cli, tmp_path, value, named, no_model_load):
    rc, _, err = cli("train", "--dataset_name", "arithmetic", "--dataset_config", value, "--output_dir", tmp_path / "r")
    assert rc == 2 and named in err
    if "sizee" in value:
        assert "did you mean 'size'" in err


def test_dataset_config_in_a_yaml_file_is_checked_for_its_task(cli, tmp_path, no_model_load):
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"dataset_name: {data}\ndataset_config: {{on_error: ignore}}\n")
    rc, _, err = cli("train", cfg, "--output_dir", tmp_path / "r")
    assert rc == 2 and "dataset_config.on_error: 'ignore'" in err and "'raise' or 'skip'" in err


def test_reasoning_gym_generator_options_are_checked_by_name(cli, tmp_path, no_model_load):
    pytest.importorskip("reasoning_gym")
    rc, _, err = cli("train", "--dataset_name", "rg:chain_sum", "--dataset_config", "{min_termz: 2}",
                     "--output_dir", tmp_path / "r")
    assert rc == 2 and "unknown option 'min_termz'" in err and "did you mean 'min_terms'" in err


def test_eval_samples_zero_is_a_usage_error(cli):
    rc, _, err = cli("eval", "--samples", "0")
    assert rc == 2 and "--samples" in err and "must be >= 1" in err


def test_a_model_folder_without_a_tokenizer(cli, tmp_path, no_model_load):
    save_tiny(tmp_path / "bare", "llama")
    rc, _, err = cli("generate", tmp_path / "bare", "--prompt", "hi")
    assert rc == 2 and "no tokenizer" in err and str(tmp_path / "bare") in err
    rc, _, err = cli("train", "--model", tmp_path / "bare", "--output_dir", tmp_path / "r")
    assert rc == 2 and "no tokenizer" in err


@pytest.mark.parametrize("family, label, model_type, named", [
    ("llama", "Qwen3ForCausalLM", "qwen3", "q_norm.weight"),   # the label wants tensors the folder lacks
    ("qwen3", "LlamaForCausalLM", "llama", "q_norm.weight"),   # tensors the label has no place for
    ("llama", "Qwen2ForCausalLM", "qwen2", "q_proj.bias"),     # biases the label wants
    ("qwen2", "LlamaForCausalLM", "llama", "q_proj.bias"),     # biases the label would drop
])
def test_an_architecture_label_that_does_not_match_the_tensors(cli, tmp_path, family, label, model_type, named):
    d = tmp_path / "m"
    save_tiny(d, family)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=[label], model_type=model_type)
    (d / "config.json").write_text(json.dumps(cfg))
    rc, _, err = cli("inspect", d)
    assert rc == 2 and f"{d}/config.json says {label}" in err and named in err
    assert "architecture label does not match the tensors" in err


def test_an_evaluation_row_without_a_prompt_past_row_0_names_the_row():
    from qerl.rl.evaluate import evaluate

    rows = [{"prompt": "1 + 1?", "answer": "2"}, {"prompt": "2 + 2?", "answer": "4"}, {"question": "3 + 3?", "answer": "6"}]
    with pytest.raises(ValueError, match=r"held-out row 2: no 'prompt' \(columns: answer, question\)"):
        evaluate(None, None, rows, None, dataset="held-out")  # fails before touching the engine
    rows[2] = {"prompt": "3 + 3?"}
    with pytest.raises(ValueError, match=r"held-out row 2: missing column\(s\) \['answer'\] that row 0 has"):
        evaluate(None, None, rows, None, dataset="held-out")


def test_a_file_row_without_the_question_column_past_row_0_names_file_and_line(cli, tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", ROWS[:3] + [{"answer": "9"}])
    rc, _, err = cli("eval", "--dataset", data)
    assert rc == 2 and f"{data} line 4: missing field 'question'" in err


# ---- silently wrong before -----------------------------------------------------------------------
def test_an_adapter_with_an_overflowing_lora_alpha_is_refused(cli, tmp_path, model):
    from qerl.checkpoint import save_adapter
    from qerl.model import load_policy

    pol = load_policy(str(model), "nvfp4", lora_rank=4, progress=False, dtype=torch.float32)
    a = save_adapter(pol, tmp_path / "adapter")
    cfg = json.loads((a / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 1e308
    (a / "adapter_config.json").write_text(json.dumps(cfg))
    rc, out, err = cli("generate", model, "--adapter", a, "--prompt", "hi", "--max-new-tokens", "2")
    assert rc == 2 and f"{a}/adapter_config.json: lora_alpha 1e+308" in err and out == ""
    cfg["lora_alpha"] = float("nan")
    (a / "adapter_config.json").write_text(json.dumps(cfg))  # json writes NaN, json reads it back
    assert cli("generate", model, "--adapter", a, "--prompt", "hi")[0] == 2


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_eval_limit_below_one_is_a_usage_error(cli, limit):
    rc, _, err = cli("eval", "--limit", limit)
    assert rc == 2 and "--limit" in err and "must be >= 1" in err


def test_eval_limit_takes_exactly_the_first_n(cli, tmp_path, model):
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    rc, out, _ = cli("eval", model, "--dataset", data, "--dataset-config", "{eval_size: 10}", "--limit", "3",
                     "--max-new-tokens", "2", "--greedy", "--device", "cpu")
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["problems"] == 3


@pytest.mark.parametrize("flag, value, shown", [("--n", "0", "--n"), ("--max-new-tokens", "0", "--max_completion_length"),
                                                 ("--top-p", "0", "--top_p"), ("--temperature", "-1", "--temperature")])
def test_generate_counts_below_their_range_are_usage_errors(cli, flag, value, shown):
    rc, _, err = cli("generate", "--prompt", "hi", flag, value)
    assert rc == 2 and f"argument {shown}:" in err  # named as --help shows it (issue 49), whatever spelling was typed


def test_the_numeric_reward_does_not_read_a_number_out_of_an_expression():
    from qerl.tasks.rewards import numeric_accuracy

    cases = [(r"\boxed{\sqrt{2}}", "2", 0.0), (r"\boxed{2^{10}}", "10", 0.0), (r"\boxed{2\pi}", "2", 0.0),
             (r"\boxed{2}", "2", 1.0), (r"\boxed{\text{12}}", "12", 1.0), (r"\boxed{\frac{3}{4}}", "0.75", 1.0),
             ("so she has 12 apples.", "12", 1.0), (r"\boxed{1024}", "1024", 1.0)]
    assert numeric_accuracy([c for c, _, _ in cases], [a for _, a, _ in cases]) == [w for _, _, w in cases]


# ---- unclear before ------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/nonexistent-qerl/model", "./no/such/model", "no/such/model/"])
def test_a_missing_local_path_is_a_missing_folder_not_a_bad_hub_id(cli, path):
    rc, _, err = cli("generate", path, "--prompt", "hi")
    # the words of the message, without its paths (the checkout's own path may hold "repo" or "hub")
    words = " ".join(w for w in err.lower().split() if "/" not in w and "'" not in w)
    assert rc == 2 and "no such model folder" in err and "hub" not in words and "repo" not in words


def test_a_binary_jsonl_names_the_file_and_line(cli, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(json.dumps(ROWS[0]).encode() + b"\n\x89PNG\r\n\x1a\n\x00\xff\xfe")
    rc, _, err = cli("eval", "--dataset", data)
    assert rc == 2 and f"{data} line 2: not UTF-8 text" in err


def test_a_bom_and_blank_lines_in_a_jsonl_load(tmp_path):
    from qerl.tasks.data import load_file

    plain = _jsonl(tmp_path / "plain.jsonl", ROWS)
    bom = _jsonl(tmp_path / "bom.jsonl", ROWS, raw="\ufeff".encode())
    bom.write_bytes(bom.read_bytes().replace(b"\n", b"\n\n", 3) + b"\n  \n")  # blank lines inside and at the end
    want = [json.loads(x)["question"] for x in plain.read_text().splitlines()]
    assert [r["question"] for r in load_file(bom).rows] == want
    assert [r["question"] for r in load_file(plain).rows] == want


def test_a_later_bad_row_keeps_its_line_number_after_blank_lines(tmp_path):
    from qerl.tasks.data import DataError, load_file

    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n\n" + "{oops\n")
    with pytest.raises(DataError, match=r"d\.jsonl line 3: not valid JSON"):
        load_file(p)


def test_skipped_rows_are_shown(cli, tmp_path, model):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join([json.dumps(r) for r in ROWS[:12]] + ["{broken", json.dumps({"question": "q"})]) + "\n")
    rc, _, err = cli("eval", model, "--dataset", data, "--dataset-config", "{on_error: skip, eval_size: 2}",
                     "--max-new-tokens", "2", "--greedy", "--device", "cpu")
    assert rc == 0 and "skipped 2 malformed row(s); first:" in err and "line 13" in err


def test_train_shows_skipped_rows_before_training(tmp_path, model, capsys):
    from qerl.cli.preflight import preflight
    from qerl.rl import GRPOConfig

    data = tmp_path / "d.jsonl"
    data.write_text("\n".join([json.dumps(r) for r in ROWS] + ["{broken"]) + "\n")
    task = preflight(GRPOConfig(dataset_name=str(data), dataset_config={"on_error": "skip"},
                                model_name_or_path=str(model)))
    assert len(task.train) + len(task.eval) == len(ROWS)
    assert f"qerl train: dataset {data}: skipped 1 malformed row(s)" in capsys.readouterr().err


def test_a_tiny_dataset_with_eval_on_end_fails_before_training(cli, tmp_path, model, no_model_load):
    data = _jsonl(tmp_path / "tiny.jsonl", ROWS[:5])  # 5 rows: the default held-out tenth is empty
    run = tmp_path / "run"
    rc, _, err = cli("train", "--model", model, "--dataset_name", data, "--eval_on_end", "--output_dir", run)
    assert rc == 2 and "no held-out problems" in err and "eval_size" in err
    assert not (run / "metrics.jsonl").exists()


def test_a_tiny_dataset_with_a_held_out_row_passes_the_preflight(tmp_path, model):
    from qerl.cli.preflight import preflight
    from qerl.rl import GRPOConfig

    data = _jsonl(tmp_path / "tiny.jsonl", ROWS[:5])
    task = preflight(GRPOConfig(dataset_name=str(data), dataset_config={"eval_size": 1}, eval_on_end=True,
                                model_name_or_path=str(model)))
    assert (len(task.train), len(task.eval)) == (4, 1)


def test_an_empty_training_split_fails_before_training(cli, tmp_path, no_model_load):
    rc, _, err = cli("train", "--dataset_name", "gsm8k-offline", "--output_dir", tmp_path / "r")
    assert rc == 2 and "no training rows" in err and "evaluation-only" in err


def test_debug_mode_keeps_the_traceback(monkeypatch):
    monkeypatch.setenv("QERL_DEBUG", "1")
    with pytest.raises(ValueError, match="lora_r"):
        main(["train", "--lora_r", "0", "--print_config"])


def test_a_valid_lora_alpha_still_loads(tmp_path, model):
    """The bound refuses only what overflows: a normal adapter's outputs stay finite and it loads."""
    from qerl.checkpoint import load_adapter, save_adapter
    from qerl.model import load_policy

    pol = load_policy(str(model), "nvfp4", lora_rank=4, lora_alpha=8, progress=False, dtype=torch.float32)
    a = save_adapter(pol, tmp_path / "adapter")
    load_adapter(pol, a)
    with torch.no_grad():
        assert math.isfinite(pol.model(torch.tensor([[3, 4, 5]])).logits.abs().max().item())
