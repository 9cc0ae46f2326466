"""Issue 34, silent wrong results: each case now fails loudly, counts, or is right.
Checkpoint checksums (bytes flipped in place), reward functions returning NaN/inf/huge values or the
wrong count, numeric rewards of expressions, every config field's range, lengths beyond the model's
positions, and tool_call_rate 0 when tools are offered and never called."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import save_tiny, tiny_tokenizer

from qerl.rl.rewards import score


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("m") / "m"
    save_tiny(d, "llama")  # 128 positions
    tiny_tokenizer().save_pretrained(d)
    return d


def train_args(model, out, *extra):
    return ["train", "--model", model, "--dataset_name", "arithmetic", "--dataset_config", "{size: 16, eval_size: 4}",
            "--max_steps", "2", "--generation_batch_size", "4", "--num_generations", "2",
            "--per_device_train_batch_size", "4", "--max_completion_length", "4", "--max_prompt_length", "64",
            "--aqn_stages", "2", "--save_steps", "1", "--report_to", "none", "--parity_check_steps", "0",
            "--optim", "adamw_torch", "--save_total_limit", "2", "--eval_on_start", "false", "--eval_on_end", "false",
            "--output_dir", out, *extra]


# ---- checkpoints: checksums written at save, verified at resume -----------------------------------
def test_bytes_flipped_inside_a_checkpoint_fall_back_to_the_previous_one(cli, model, tmp_path):
    from safetensors.torch import load_file

    run = tmp_path / "run"
    assert cli(*train_args(model, run))[0] == 0
    assert json.loads((run / "checkpoint-2" / "checksums.json").read_text())["files"]["trainable.safetensors"]
    f = run / "checkpoint-2" / "trainable.safetensors"
    data = bytearray(f.read_bytes())
    data[-200:-136] = bytes(b ^ 0x5A for b in data[-200:-136])  # 64 bytes inside the last tensor, same size
    f.write_bytes(bytes(data))
    one = load_file(run / "checkpoint-1" / "trainable.safetensors")
    rc, out, err = cli("train", "--resume", run, "--max_steps", "2")
    assert rc == 0, err
    assert "skipping checkpoint-2" in out and "bytes changed" in out and "at step 1/2" in out
    assert (run / "checkpoint-2.corrupt").is_dir()
    # the rerun step 2 started from checkpoint-1's values (a fresh checkpoint-2 was written from them)
    assert set(load_file(run / "checkpoint-2" / "trainable.safetensors")) == set(one)


def test_checksums_name_the_changed_file(tmp_path):
    from qerl.checkpoint.checksums import ChecksumError, verify_checksums, write_checksums

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"\0" * 100)
    (tmp_path / "y.json").write_text("{}")
    write_checksums(tmp_path)
    assert verify_checksums(tmp_path)
    (tmp_path / "a" / "x.bin").write_bytes(b"\0" * 99 + b"\1")
    with pytest.raises(ChecksumError, match=r"x\.bin: its bytes changed"):
        verify_checksums(tmp_path)
    (tmp_path / "y.json").unlink()
    assert not verify_checksums(tmp_path / "a")  # no checksums.json: not checked


# ---- reward functions --------------------------------------------------------------------------
@pytest.mark.parametrize("value, needle", [(math.nan, "nan"), (math.inf, "inf"), (1e308, "beyond"),
                                           ("1", "not a number"), ([1.0], "not a number")])
def test_a_reward_that_is_not_a_usable_number_is_a_counted_error(value, needle):
    def f(completions, **_):
        return [1.0, value, 0.5]

    sc = score([f], None, ["a", "b", "c"], {})
    assert sc.total == [1.0, 0.0, 0.5] and sc.errors == 1 and needle in sc.first_error


def test_a_reward_of_none_is_not_applicable_rather_than_an_error():
    # TRL's convention: None where a function does not apply to a completion; it scores nothing there
    sc = score([lambda completions, **_: [1.0, None, 0.5]], None, ["a", "b", "c"], {})
    assert sc.total == [1.0, 0.0, 0.5] and sc.errors == 0 and math.isnan(list(sc.per_func.values())[0][1])


def test_a_reward_of_the_wrong_count_is_an_error_for_every_completion():
    calls = []

    def one(completions, **_):
        calls.append(len(completions))
        return [1.0]

    sc = score([one], None, ["a", "b", "c", "d"], {})
    assert sc.total == [0.0] * 4 and sc.errors == 4 and "returned 1 values for 4 completions" in sc.first_error
    assert calls == [4]  # not retried one by one (which scored every completion 1.0)


def test_bools_are_rewards():
    sc = score([lambda completions, **_: [c == "a" for c in completions]], None, ["a", "b"], {})
    assert sc.total == [1.0, 0.0] and sc.errors == 0


@pytest.mark.parametrize("completion, answer, want", [
    (r"\boxed{\sqrt[3]{2}}", "2", 0.0), (r"\boxed{\sqrt{{2}}}", "2", 0.0), (r"\boxed{\dfrac{\sqrt{2}}{1}}", "1", 0.0),
    (r"\boxed{2^{1}}", "2", 1.0), (r"\boxed{\log_2 4}", "2", 1.0), (r"\boxed{3!}", "6", 1.0),
    (r"\boxed{2\pi}", "2", 0.0), ("so she has 1,234 apples.", "#### 1234", 1.0), (r"\boxed{\text{12}}", "12", 1.0),
    (r"\boxed{\frac{3}{4}}", "0.75", 1.0), ("The answer is $5.50", "5.5", 1.0), ("42", "41", 0.0),
])
def test_numeric_reward_values_expressions_with_math_verify(completion, answer, want):
    from qerl.tasks.answers import is_plain_number
    from qerl.tasks.rewards import numeric_accuracy

    assert numeric_accuracy([completion], [answer]) == [want]
    assert is_plain_number("so she has 1,234 apples.") and not is_plain_number(r"\log_2 4")


# ---- every field in its range, before any model loads ---------------------------------------------
@pytest.mark.parametrize("flags, field", [
    (["--aqn_sigma_start", "inf"], "aqn_sigma_start"), (["--aqn_sigma_start", "1e30"], "aqn_sigma_start"),
    (["--aqn_sigma_start", "-1"], "aqn_sigma_start"), (["--epsilon", "-1"], "epsilon"), (["--beta", "-1"], "beta"),
    (["--aqn_schedule", "adaptive", "--aqn_adaptive_signal", "zero_variance", "--aqn_adaptive_target", "2"],
     "aqn_adaptive_target"),
    (["--report_to", "neptune"], "report_to"), (["--learning_rate", "inf"], "learning_rate"),
    (["--learning_rate", "-1e-3"], "learning_rate"), (["--tool_timeout_s", "inf"], "tool_timeout_s"),
    (["--seed", str(2**70)], "seed"), (["--max_prompt_length", "0"], "max_prompt_length"),
    (["--lora_target_modules", "[]"], "lora_target_modules"), (["--parity_max_logprob_diff", "0"],
                                                               "parity_max_logprob_diff"),
    (["--temperature", "0"], "temperature"), (["--adam_beta2", "1"], "adam_beta2"),
    (["--weight_decay", "nan"], "weight_decay"),
])
def test_out_of_range_values_name_their_field(cli, tmp_path, flags, field, no_model_load):
    rc, _, err = cli("train", *flags, "--output_dir", tmp_path / "run")
    assert rc == 2 and (f"'{field}'" in err or f"--{field}" in err), err
    assert len(err.strip().splitlines()) == 1


def test_every_default_and_the_default_run_are_in_range():
    from qerl.rl import GRPOConfig
    from qerl.rl.default_run import default_run_config

    GRPOConfig()
    default_run_config("cpu")
    default_run_config("cuda")


# ---- lengths beyond the model's positions ----------------------------------------------------------
def test_generate_refuses_more_new_tokens_than_positions_before_loading(cli, model, no_model_load):
    rc, _, err = cli("generate", model, "--prompt", "hi", "--max-new-tokens", "100000", "--device", "cpu")
    assert rc == 2 and "beyond the model's 128 positions" in err


def test_generate_refuses_a_prompt_beyond_the_positions(cli, model):
    rc, _, err = cli("generate", model, "--prompt", "x" * 5000, "--max-new-tokens", "4", "--device", "cpu")
    assert rc == 2 and "--prompt 1" in err and "beyond the model's 128 positions" in err


def test_eval_refuses_prompts_beyond_the_positions(cli, model):
    rc, _, err = cli("eval", model, "--dataset", "arithmetic", "--max-new-tokens", "120", "--limit", "1",
                     "--device", "cpu")
    assert rc == 2 and "beyond the model's 128 positions" in err


def test_train_warning_text(model, tmp_path, capsys):
    from qerl.cli.preflight import preflight
    from qerl.rl import GRPOConfig

    preflight(GRPOConfig(model_name_or_path=str(model), max_prompt_length=64, max_completion_length=100,
                         dataset_config={"size": 8, "eval_size": 2}, output_dir=str(tmp_path / "r")))
    assert "exceed the model's 128 positions" in capsys.readouterr().err


# ---- tool_call_rate is 0, not missing, when tools are offered and never called ---------------------
def test_tool_call_rate_is_zero_when_tools_are_offered_and_never_called(tmp_path):
    from qerl.model import random_policy
    from qerl.rl import GRPOConfig, GRPOTrainer
    from qerl.tasks import get_task
    from qerl.tools import calculator
    from tiny_models import config

    torch.manual_seed(0)
    pol = random_policy(config("llama"), "nvfp4", lora_rank=2, device="cpu", dtype=torch.float32, progress=False)
    pol.tokenizer = tiny_tokenizer()
    cfg = GRPOConfig(max_steps=1, generation_batch_size=4, num_generations=2, per_device_train_batch_size=4,
                     max_completion_length=4, max_prompt_length=100, aqn=False, output_dir=str(tmp_path / "r"),
                     report_to="none", parity_check_steps=0, optim="adamw_torch", dynamic_sampling=False)
    rows = GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=8), tools=[calculator],
                       progress=False).train()
    assert rows[0]["tool_call_rate"] == 0.0 and rows[0]["tool_turns_mean"] == 0.0
