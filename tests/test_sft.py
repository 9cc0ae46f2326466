"""qerl sft on the CPU: the loss against a per-example NLL computed with the plain HF forward
(packed rows and padded rows), the trained-token masks of every row format, the tool task's
transcripts against the rollout's own token ids, exact resume, the adapter as a start for GRPO
and PEFT, and the config / command line."""

import json
import re
from pathlib import Path

import pytest
import torch

from qerl.model import random_policy
from qerl.sft import SFTConfig, SFTTrainer
from qerl.sft.batch import sft_batch
from qerl.sft.data import Tokenizer
from tiny_models import config, save_tiny, tiny_tokenizer


def _rows(n=8):
    return [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"add {i} {i + 3}"},
                          {"role": "assistant", "content": f"<c>{i}+{i + 3}</c>"},
                          {"role": "tool", "content": str(2 * i + 3)},
                          {"role": "assistant", "content": f"= {2 * i + 3}"}]} for i in range(n)]


def _policy():
    pol = random_policy(config("qwen2"), "nvfp4", lora_rank=4, device="cpu", dtype=torch.float32, std=0.05,
                        progress=False)
    pol.tokenizer = tiny_tokenizer()
    return pol


def _trainer(out, rows=None, policy=None, **kw):
    base = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                assistant_only_loss=True, report_to="none", device="cpu", save_steps=2, logging_steps=1)
    return SFTTrainer(SFTConfig(**{**base, **kw}), policy=policy or _policy(), train_dataset=rows or _rows(),
                      progress=False)


def _trained_text(tok, ex):
    return "".join(tok.decode([i]) for i, t in zip(ex.ids, ex.trained) if t)


def _reference_nll(model, examples):
    """Token-mean NLL of the trained tokens, each example alone through the HF forward."""
    total, n = 0.0, 0
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([e.ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            lp = logp.gather(-1, ids[0, 1:, None])[:, 0]
            m = torch.tensor(e.trained[1:])
            total += float(-lp[m].sum())
            n += int(m.sum())
    return total / n


# ---- the loss --------------------------------------------------------------------------------
@pytest.mark.parametrize("packing", [True, False])
def test_the_first_step_loss_is_the_token_mean_nll_of_each_example_alone(tmp_path, packing):
    torch.manual_seed(0)
    tr = _trainer(tmp_path, packing=packing, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    with torch.no_grad():  # a non-zero adapter, so the LoRA path is in the comparison
        for n, p in tr.model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05)
    order = tr.sampler.order[:8]
    ref = _reference_nll(tr.model, [tr.examples[i] for i in order])
    m = tr.train_step()
    assert m["loss"] == pytest.approx(ref, rel=1e-4)
    assert m["num_tokens"] == sum(sum(tr.examples[i].trained) for i in order)


def test_packing_shares_the_common_tokens_and_keeps_examples_apart():
    tok = tiny_tokenizer()
    exs = Tokenizer(tok, assistant_only_loss=True)(_rows(4)).examples
    batch = sft_batch(exs, 4)
    prefix = batch.completions[0].prompt_ids
    assert all(c.prompt_ids == prefix for c in batch.completions)  # one row: the shared part once
    assert tok.decode(prefix).startswith("system: be brief\nuser: add ")
    for c, e in zip(batch.completions, exs):  # each example whole: shared part + its own rest
        assert c.prompt_ids + c.token_ids == e.ids
        own = [t for t, keep in zip(c.token_ids, c.model_token_mask()) if keep]
        assert tok.decode(own) == _trained_text(tok, e)


# ---- what each row format trains on -----------------------------------------------------------
def test_assistant_only_loss_trains_the_assistant_turns_only():
    tok = tiny_tokenizer()
    ex = Tokenizer(tok, assistant_only_loss=True)(_rows(1)).examples[0]
    assert tok.decode(ex.ids) == ("system: be brief\nuser: add 0 3\nassistant: <c>0+3</c>\nuser: <tool_response>\n3\n"
                                  "</tool_response>\nassistant: = 3\n")
    assert _trained_text(tok, ex) == "<c>0+3</c>= 3"
    every = Tokenizer(tok)(_rows(1)).examples[0]  # without it: every token but the first
    assert every.ids == ex.ids and every.trained == [False] + [True] * (len(ex.ids) - 1)


def test_text_and_prompt_completion_rows():
    tok = tiny_tokenizer()
    t = Tokenizer(tok)
    text = t([{"text": "hello"}]).examples[0]
    assert text.ids[-1] == tok.eos_token_id and _trained_text(tok, text) == "ello<eos>"
    pc = t([{"prompt": "2+2=", "completion": "4"}]).examples[0]
    assert tok.decode(pc.ids) == "2+2=4<eos>" and _trained_text(tok, pc) == "4<eos>"
    pc_all = Tokenizer(tok, completion_only_loss=False)([{"prompt": "2+2=", "completion": "4"}]).examples[0]
    assert _trained_text(tok, pc_all) == "+2=4<eos>"
    conv = t([{"prompt": [{"role": "user", "content": "hi"}],
               "completion": [{"role": "assistant", "content": "yo"}]}]).examples[0]
    assert _trained_text(tok, conv) == "yo"


def test_max_length_cuts_and_drops_examples_with_nothing_left():
    tok = tiny_tokenizer()
    long_system = {"messages": [{"role": "system", "content": "x" * 60}, {"role": "user", "content": "q"},
                                {"role": "assistant", "content": "a"}]}
    out = Tokenizer(tok, assistant_only_loss=True, max_length=50)(_rows(1) + [long_system])
    assert (out.truncated, out.dropped, len(out.examples)) == (2, 1, 1)
    assert len(out.examples[0].ids) == 50 and _trained_text(tok, out.examples[0]) == "<c>0+3</c>"[:8]
    with pytest.raises(ValueError, match="no example has a token to train on"):
        Tokenizer(tok, assistant_only_loss=True, max_length=10)(_rows(2))


@pytest.mark.parametrize("row, msg", [
    ({"question": "x"}, r"row 0: no 'messages', 'text' or 'prompt' \+ 'completion' field \(fields: \['question'\]\)"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "row 0: message 0: expected a role"),
    ({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]}, "both be text or both be message lists"),
    ({"text": 3}, "'text' is int, not text"),
])
def test_bad_rows_are_named(row, msg):
    with pytest.raises(ValueError, match=msg):
        Tokenizer(tiny_tokenizer(), source="data.jsonl")([row])


@pytest.mark.parametrize("fmt", ["messages", "text", "prompt-completion"])
def test_a_lone_surrogate_in_a_data_file_names_file_line_and_field(cli, model, tmp_path, fmt):
    good = {"messages": _rows(1)[0], "text": {"text": "fine"}, "prompt-completion": {"prompt": "1+1", "completion": "2"}}
    bad = json.loads(json.dumps(good[fmt]))
    field = {"messages": "'messages'[3]['content']", "text": "'text'", "prompt-completion": "'completion'"}[fmt]
    if fmt == "messages":
        bad["messages"][3]["content"] = "4\ud800"
    else:
        bad[{"text": "text", "prompt-completion": "completion"}[fmt]] = "ok \ud800"
    data = tmp_path / "d.jsonl"
    # json.dumps writes the surrogate as the escape "\ud800", as a broken exporter does; line 3, after a blank one
    data.write_text(json.dumps(good[fmt]) + "\n\n" + json.dumps(bad) + "\n")
    rc, _, err = cli("sft", "--model_name_or_path", model, "--dataset_name", data, "--max_steps", "1",
                     "--report_to", "none", "--output_dir", tmp_path / "run")
    last = err.strip().splitlines()[-1]
    assert rc == 2 and f"{data} line 3: field {field} holds a lone surrogate" in last, err
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_a_lone_surrogate_in_api_rows_names_the_row_and_field():
    rows = _rows(3)
    rows[2]["messages"][1]["content"] = "add \ud800"
    with pytest.raises(ValueError, match=re.escape("train_dataset: row 2: field 'messages'[1]['content'] holds a lone "
                                                   "surrogate '\\ud800' at character 5")):
        Tokenizer(tiny_tokenizer(), source="train_dataset")(rows)


def test_api_data_files_that_are_not_regular_files_are_named(tmp_path):
    import os

    from qerl.sft.data import load_rows

    if not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"):
        pytest.skip("POSIX")
    fifo = tmp_path / "rows"  # no suffix: still a local path, never a hub id
    os.mkfifo(fifo)
    link = tmp_path / "zero.jsonl"
    link.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=f"dataset_name {fifo}: is a FIFO"):  # returns at once: never opened
        load_rows(str(fifo), {})
    with pytest.raises(ValueError, match=f"dataset_name {link} \\(a link to /dev/zero\\): is a character device"):
        load_rows(str(link), {})
    with pytest.raises(ValueError, match=f"dataset_name {tmp_path}: is a folder"):
        load_rows(str(tmp_path), {})


# ---- the tool task's transcripts ---------------------------------------------------------------
def test_tool_transcripts_come_from_the_training_split_and_make_a_rollouts_tokens():
    from qerl.model.resolve import resolve_model
    from qerl.tasks import get_task
    from qerl.tasks.prompts import encode_prompt
    from qerl.tasks.tool_arithmetic import transcripts
    from qerl.tools import ToolEnvironment, parse_tool_calls, tool_response_ids
    from transformers import AutoTokenizer

    task = get_task("tool_arithmetic", size=30, eval_size=10)
    rows = transcripts(task.train)
    assert len(rows) == len(task.train)  # every integer answer is the calculator's
    env = ToolEnvironment(task.tools)
    for row, src in zip(rows, task.train):
        msgs = row["messages"]
        assert msgs[:len(src["prompt"])] == src["prompt"]
        call, tool, final = msgs[len(src["prompt"]):]
        (parsed,) = parse_tool_calls(call["content"], env.tools)
        assert parsed.error is None and parsed.name == "calculator"
        assert env.respond(call["content"])[0]["content"] == tool["content"] == src["answer"]
        assert final["content"] == f"<answer>{src['answer']}</answer>"
    tok = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    ex = Tokenizer(tok, assistant_only_loss=True)(rows[:1]).examples[0]
    prompt = encode_prompt(tok, task.train[0]["prompt"])
    assert ex.ids[:len(prompt)] == prompt and not any(ex.trained[:len(prompt)])  # the rollout's prompt ids
    call = tok(rows[0]["messages"][-3]["content"], add_special_tokens=False)["input_ids"]
    assert ex.ids[len(prompt):len(prompt) + len(call)] == call and all(ex.trained[len(prompt):len(prompt) + len(call)])
    # after the call: the ids the rollout engine appends for the tool's answer (the end-of-turn token trained)
    after = len(prompt) + len(call)
    tool_ids = tool_response_ids(tok, [rows[0]["messages"][-2]])
    assert ex.ids[after:after + len(tool_ids)] == tool_ids
    assert ex.trained[after:after + len(tool_ids)] == [True] + [False] * (len(tool_ids) - 1)
    tail = tok.decode([i for i, t in zip(ex.ids[after + 1:], ex.trained[after + 1:]) if t])
    assert tail == f"<answer>{task.train[0]['answer']}</answer><|im_end|>"


# ---- checkpoints, resume and the adapter ------------------------------------------------------------
def _trainable(tr):
    return {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}


def test_resume_continues_exactly(tmp_path):
    torch.manual_seed(0)
    full = _trainer(tmp_path / "a", lora_dropout=0.0)
    rows_a = full.train()
    torch.manual_seed(0)
    half = _trainer(tmp_path / "b")
    half.train(stop_after=2)
    assert (tmp_path / "b" / "checkpoint-2" / "adapter" / "adapter_model.safetensors").exists()
    torch.manual_seed(1)  # the resume restores the RNG and the data position itself
    again = _trainer(tmp_path / "b")
    assert again.resume() == 2
    rows_b = again.train()
    assert [r["loss"] for r in rows_a[2:]] == [r["loss"] for r in rows_b]
    a, b = _trainable(full), _trainable(again)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="already holds a run"):
        _trainer(tmp_path / "b").train()


def test_the_adapter_starts_grpo_and_loads_in_peft(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from qerl.model import load_policy
    from qerl.rl import GRPOConfig, GRPOTrainer
    from qerl.tasks import get_task

    base = tmp_path / "base"
    save_tiny(base, "qwen2")
    tiny_tokenizer().save_pretrained(base)
    tr = SFTTrainer(SFTConfig(model_name_or_path=str(base), lora_r=4, lora_alpha=8, max_steps=2, learning_rate=5e-2,
                              per_device_train_batch_size=4, assistant_only_loss=True, output_dir=str(tmp_path / "sft"),
                              report_to="none", device="cpu", dtype="float32"), train_dataset=_rows(), progress=False)
    tr.train()
    trained = {n: p.detach() for n, p in tr.model.named_parameters() if ".lora_B." in n}
    assert any(t.abs().sum() > 0 for t in trained.values())
    adapter = tmp_path / "sft" / "adapter"
    pol = load_policy(str(adapter), "nvfp4", lora_rank=32, device="cpu", dtype=torch.float32, progress=False)
    assert pol.lora_rank == 4
    got = dict(pol.model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in trained.items())
    grpo = GRPOTrainer(GRPOConfig(model_name_or_path=str(adapter), lora_r=4, device="cpu", dtype="float32",
                                  max_steps=1, num_generations=2, per_device_train_batch_size=2,
                                  output_dir=str(tmp_path / "rl"), report_to="none", max_completion_length=4),
                       task=get_task("arithmetic", size=8, eval_size=2), progress=False)
    assert all(torch.equal(dict(grpo.model.named_parameters())[n], t) for n, t in trained.items())
    grpo.train()  # its adapter names the real base (not the SFT adapter it started from), so PEFT loads it too
    rl = load_policy(str(tmp_path / "rl" / "adapter"), "nvfp4", device="cpu", dtype=torch.float32, progress=False)
    assert rl.source == base and rl.lora_rank == 4
    rl_cfg = json.loads((tmp_path / "rl" / "adapter" / "adapter_config.json").read_text())
    assert Path(rl_cfg["base_model_name_or_path"]).resolve() == base.resolve()
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(rl_cfg["base_model_name_or_path"]),
                              tmp_path / "rl" / "adapter")
    pm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter)
    peft_b = {k: v for k, v in pm.state_dict().items() if "lora_B" in k}
    assert len(peft_b) == len(trained)
    for n, t in trained.items():
        key = "base_model.model." + n.replace(".lora_B.weight", ".lora_B.default.weight")
        assert torch.equal(peft_b[key], t)


# ---- config and command line ----------------------------------------------------------------------
def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="config field 'max_steps'"):
        SFTConfig(max_steps=0)
    with pytest.raises(ValueError, match="config field 'lora_r'"):
        SFTConfig(lora_r=-4)
    f = tmp_path / "c.yaml"
    f.write_text("max_step: 5\n")
    with pytest.raises(ValueError, match=re.escape(f"{f}: unknown field 'max_step' (did you mean 'max_steps'?)")):
        SFTConfig.from_yaml(f)
    with pytest.raises(ValueError, match="--packing: 'maybe' is not a boolean"):
        SFTConfig().with_overrides({"packing": "maybe"})
    assert SFTConfig(max_steps=-1, num_train_epochs=2, per_device_train_batch_size=4).steps_for(10) == 5


def test_cli_help_lists_every_field_and_print_config_round_trips(tmp_path, capsys):
    import dataclasses

    from qerl.cli import main
    from qerl.cli.sft import GROUPS

    assert {n for g in GROUPS.values() for n in g} == {f.name for f in dataclasses.fields(SFTConfig)}
    assert main(["sft", "--print_config", "--max_steps", "7", "--packing", "false"]) == 0
    f = tmp_path / "c.yaml"
    f.write_text(capsys.readouterr().out)
    assert SFTConfig.from_yaml(f) == SFTConfig(max_steps=7, packing=False)
    assert main(["sft", str(f), "--seed", "3", "--print_config"]) == 0  # CONFIG.yaml, then flags on top
    out = capsys.readouterr().out.splitlines()
    assert "max_steps: 7" in out and "packing: false" in out and "seed: 3" in out
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    assert "--assistant_only_loss" in capsys.readouterr().out
    assert main(["sft", "--max_steps", "0"]) == 2
    assert "config field 'max_steps'" in capsys.readouterr().err
    assert main(["sft", "--learning_rat", "1e-5", "--print_config"]) == 2
    assert "did you mean '--learning_rate'" in capsys.readouterr().err


def test_sft_stands_on_train_alone():
    """sft/ imports nothing from rl/ (issue 48): a change to GRPO's loss or update cannot change SFT."""
    import ast

    import qerl.sft

    for f in Path(qerl.sft.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                assert not (mod.startswith("..rl") or mod.startswith("qerl.rl")), f"{f.name} imports {mod}"
