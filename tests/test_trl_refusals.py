"""Issue 40, silent and crashes in `qerl.trl`: LoraConfig fields qerl does not implement (use_rslora,
use_dora, modules_to_save, bias) are refused, not dropped; PEFT's regex string for target_modules
selects what PEFT selects; peft_config and args given as mappings work; reward functions that fail on
every call stop the run naming the function and what it returned (it trained on zeros, exit 0)."""

from __future__ import annotations

import json

import pytest

from qerl.rl.rewards import RewardFunctionError



ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)]


def _args(tmp_path, **kw):
    from qerl.trl import GRPOConfig

    return GRPOConfig(**{**dict(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4,
                                num_generations=2, max_completion_length=4, report_to="none", logging_steps=1,
                                parity_check_steps=0, eval_on_start=False, eval_on_end=False), **kw})


def reward_len(completions, **_):
    return [float(len(c)) for c in completions]


@pytest.mark.parametrize("field, value", [("use_rslora", True), ("use_dora", True), ("modules_to_save", ["lm_head"]),
                                          ("bias", "all"), ("layers_to_transform", [0])])
def test_lora_fields_qerl_does_not_implement_are_refused_before_loading(tmp_path, model_dir, field, value,
                                                                       no_model_load):
    from peft import LoraConfig

    from qerl.trl import GRPOTrainer

    with pytest.raises(ValueError, match=rf"peft_config\.{field}="):
        GRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args=_args(tmp_path), train_dataset=ROWS,
                    peft_config=LoraConfig(r=4, **{field: value}))


def _peft_targets(model_dir, lora_config) -> set[str]:
    """The reference: the projections PEFT itself puts LoRA on for this LoraConfig."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    m = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora_config)
    return {n.rpartition(".")[2] for n, mod in m.named_modules() if hasattr(mod, "lora_A") and n.endswith("proj")}


def _saved_targets(tr, tmp_path) -> set[str]:
    out = tr.save_model(str(tmp_path / "adapter"))
    cfg = json.loads((out / "adapter_config.json").read_text())
    return {t.rpartition(".")[2] for t in cfg["target_modules"]}, cfg


@pytest.mark.parametrize("regex", [r".*\.(q_proj|v_proj)", r".*mlp\.(up|down)_proj"])
def test_peft_regex_target_modules_select_what_peft_selects(tmp_path, model_dir, regex):
    from peft import LoraConfig

    from qerl.trl import GRPOTrainer

    lc = LoraConfig(r=4, lora_alpha=8, target_modules=regex)
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args=_args(tmp_path), train_dataset=ROWS,
                     peft_config=lc)
    got, _ = _saved_targets(tr, tmp_path)
    assert got == _peft_targets(model_dir, LoraConfig(r=4, lora_alpha=8, target_modules=regex))


def test_a_bare_alternation_of_names_is_those_names(tmp_path, model_dir):
    from peft import LoraConfig

    from qerl.trl import GRPOTrainer

    tr = GRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args=_args(tmp_path), train_dataset=ROWS,
                     peft_config=LoraConfig(r=4, target_modules="q_proj|v_proj"))
    assert _saved_targets(tr, tmp_path)[0] == {"q_proj", "v_proj"}


def test_a_regex_that_matches_nothing_is_named(tmp_path, model_dir, no_model_load):
    from peft import LoraConfig

    from qerl.trl import GRPOTrainer

    with pytest.raises(ValueError, match="matches none of the projections"):
        GRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args=_args(tmp_path), train_dataset=ROWS,
                    peft_config=LoraConfig(r=4, target_modules=r".*attention\.query"))


def test_peft_config_and_args_as_mappings(tmp_path, model_dir):
    from qerl.trl import GRPOTrainer

    args = dict(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
                max_completion_length=4, report_to="none", parity_check_steps=0)
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args=args, train_dataset=ROWS,
                     peft_config={"r": 4, "lora_alpha": 16})
    _, cfg = _saved_targets(tr, tmp_path)
    assert (cfg["r"], cfg["lora_alpha"], tr.cfg.max_steps) == (4, 16, 1)


@pytest.mark.parametrize("bad", [{"r": 4, "rank": 2}, "r=4", 4])
def test_a_peft_config_that_is_no_lora_config_is_named(tmp_path, model_dir, bad, no_model_load):
    from qerl.trl import GRPOTrainer

    with pytest.raises(ValueError, match="peft_config"):
        GRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args=_args(tmp_path), train_dataset=ROWS,
                    peft_config=bad)


def test_args_with_an_unknown_field_are_named(tmp_path, model_dir, no_model_load):
    from qerl.trl import GRPOTrainer

    with pytest.raises(ValueError, match="args: .*'max_stepz'"):
        GRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args={"max_stepz": 1}, train_dataset=ROWS)


def returns_none(completions, **_):
    return None


def returns_a_scalar(completions, **_):
    return 1.0


def returns_strings(completions, **_):
    return ["good"] * len(completions)


def returns_a_short_list(completions, **_):
    return [1.0]


def returns_a_nested_list(completions, **_):
    return [[1.0] for _ in completions]


def needs_a_missing_column(completions, solution, **_):
    return [float(c == s) for c, s in zip(completions, solution)]


@pytest.mark.parametrize("func, said", [(returns_none, "NoneType"), (returns_a_scalar, "float"),
                                        (returns_strings, "'good'"), (returns_a_short_list, "values for"),
                                        (returns_a_nested_list, "list"), (needs_a_missing_column, "solution")])
def test_a_reward_function_that_always_fails_stops_the_run_naming_it(tmp_path, model_dir, func, said):
    from qerl.trl import GRPOTrainer

    tr = GRPOTrainer(model=str(model_dir), reward_funcs=[reward_len, func], args=_args(tmp_path, max_steps=20),
                     train_dataset=ROWS)
    with pytest.raises(RewardFunctionError) as e:
        tr.train()
    msg = str(e.value)
    assert func.__name__ in msg and said in msg and "\n" not in msg, msg
    assert tr.step == 0  # stopped at the first scoring, as TRL


def test_a_reward_that_fails_sometimes_still_trains(tmp_path, model_dir):
    calls = {"n": 0}

    def flaky(completions, **_):
        calls["n"] += 1
        return [None] * len(completions) if calls["n"] % 2 else [0.5] * len(completions)  # TRL's "cannot score"

    from qerl.trl import GRPOTrainer

    tr = GRPOTrainer(model=str(model_dir), reward_funcs=[flaky], args=_args(tmp_path, max_steps=4),
                     train_dataset=ROWS)
    tr.train()
    assert tr.step == 4
