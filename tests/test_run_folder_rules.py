"""Issue 60 (nothing silent, round 6): a run folder never clears what its run reads (one guard), a resume
continues on the run's record and refuses a changed value by name (`--allow_changed FIELD` to ask for it),
and paths are taken as users write them (`~`, relative, links) and checked when the config is read."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from cli_runs import one_line, sft_args, train_args

from qerl.cli import main


def _rows(path, n=16):
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(n)))
    return path


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_run(model, tmp_path_factory):
    run = tmp_path_factory.mktemp("sft") / "R"
    assert main([str(a) for a in sft_args(model, run)]) == 0
    return run


@pytest.fixture(scope="module")
def grpo_run(model, tmp_path_factory):
    """A 1-step GRPO run with a checkpoint, run once."""
    run = tmp_path_factory.mktemp("grpo") / "R"
    assert main([str(a) for a in train_args(model, run, "--max_steps", "1")]) == 0
    return run


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- A: a folder that holds the run's own input is never cleared ------------------------------------------
@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_run_from_an_adapter_into_the_folder_holding_it_is_refused_and_keeps_it(cli, sft_run, command,
                                                                                   no_model_load):
    before = _snapshot(sft_run)
    args = (train_args(sft_run / "adapter", sft_run, "--max_steps", "1") if command == "train"
            else sft_args(sft_run / "adapter", sft_run))
    rc, _, err = cli(*args, "--overwrite_output_dir")
    assert rc == 2 and one_line(err), err
    assert f"{sft_run}: holds the run's own adapter (model_name_or_path) {sft_run / 'adapter'}" in err, err
    assert _snapshot(sft_run) == before  # nothing deleted, nothing written


def test_a_data_file_inside_the_folder_to_clear_is_named(cli, model, grpo_run, tmp_path, no_model_load):
    import shutil

    run = tmp_path / "R"
    shutil.copytree(grpo_run, run)
    data = _rows(run / "d.jsonl")
    rc, _, err = cli(*train_args(model, run, "--dataset_name", data, "--dataset_config", "{}", "--overwrite_output_dir"))
    assert rc == 2 and one_line(err) and f"holds the run's own dataset (dataset_name) {data}" in err, err
    assert (run / "checkpoint-1").is_dir() and data.is_file()


def test_an_output_folder_linked_to_the_model_folder_is_refused(tmp_path):
    from qerl.train.run_folder import RunFolderError, RunInput, check_clear

    model = tmp_path / "model"
    (model / "adapter").mkdir(parents=True)  # a model folder that looks like a run
    link = tmp_path / "out"
    link.symlink_to(model)
    with pytest.raises(RunFolderError, match="is the run's own model"):
        check_clear(link, True, [RunInput("model (model_name_or_path)", str(model))])
    inner = model / "sub"
    (inner / "adapter").mkdir(parents=True)
    with pytest.raises(RunFolderError, match="is inside the run's own model"):
        check_clear(inner, True, [RunInput("model (model_name_or_path)", str(model))])
    assert (model / "adapter").is_dir() and (inner / "adapter").is_dir()


# ---- B: a resume continues on the run's record ----------------------------------------------------------
def test_a_resume_from_another_folder_keeps_the_relative_dataset_of_the_run(cli, model, tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    _rows(a / "d.jsonl")
    monkeypatch.chdir(a)
    rc, _, err = cli(*train_args(model, "run", "--max_steps", "1", "--dataset_name", "d.jsonl", "--dataset_config",
                                 "{eval_size: 4}"))
    assert rc == 0, err
    recorded = json.loads(json.dumps(__import__("yaml").safe_load((a / "run" / "config.yaml").read_text())))
    assert recorded["dataset_name"] == str(a / "d.jsonl") and recorded["output_dir"] == str(a / "run")
    monkeypatch.chdir(b)  # b has no d.jsonl: the run's own file is read, not this folder's
    rc, out, err = cli("train", "--resume", a / "run", "--max_steps", "2")
    assert rc == 0, err
    assert [r["step"] for r in _metrics(a / "run") if "reward_mean" in r] == [1, 2]
    assert "max_steps 1 -> 2" in out  # the one change, said


@pytest.mark.parametrize("flag, value", [("--model_name_or_path", "OTHER"), ("--quant", "mxfp4")])
def test_a_resume_with_another_base_model_or_quant_is_refused_by_name(cli, grpo_run, tmp_path, flag, value,
                                                                      no_model_load):
    if value == "OTHER":
        other = tmp_path / "other"
        other.mkdir()
        value = str(other)
    before = _snapshot(grpo_run)
    rc, _, err = cli("train", "--resume", grpo_run, flag, value)
    assert rc == 2 and one_line(err), err
    name = flag[2:]
    assert f"{name} is" in err and f"--allow_changed {name}" in err and "run's record" in err, err
    assert _snapshot(grpo_run) == before


def test_allow_changed_lets_a_resume_continue_on_another_quant(cli, grpo_run, capsys, no_model_load):
    with pytest.raises(AssertionError, match="a model was loaded"):  # past every check, up to the model load
        main(["train", "--resume", str(grpo_run), "--quant", "mxfp4", "--allow-changed", "quant", "--max_steps", "2"])
    out = capsys.readouterr().out
    assert "quant 'nvfp4' -> 'mxfp4'" in out and "max_steps 1 -> 2" in out, out


def test_sft_resume_with_another_quant_is_refused(cli, sft_run, no_model_load):
    rc, _, err = cli("sft", "--resume", sft_run, "--quant", "nf4", "--max_steps", "2")
    assert rc == 2 and one_line(err) and "quant is 'nvfp4'" in err and "--allow_changed quant" in err, err


@pytest.mark.parametrize("argv, says", [
    (["--allow_changed", "quant"], "only with --resume"),
    (["--resume", "RUN", "--allow_changed", "quantt"], "not a config field (did you mean quant?)"),
    (["CFG", "--resume", "RUN"], "is not read: drop it"),
    (["--resume", "RUN", "--output_dir", "ELSEWHERE"], "names another folder"),
])
def test_the_resume_flags_are_refused_when_they_cannot_apply(cli, grpo_run, tmp_path, argv, says, no_model_load):
    (tmp_path / "c.yaml").write_text("max_steps: 3\n")
    argv = [{"RUN": str(grpo_run), "CFG": str(tmp_path / "c.yaml"), "ELSEWHERE": str(tmp_path / "x")}.get(a, a)
            for a in argv]
    rc, _, err = cli("train", *argv)
    assert rc == 2 and one_line(err) and says in err, err


def test_a_trl_config_runs_reward_funcs_survive_a_resume_from_another_folder(cli, model, tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "rules60_rewards.py").write_text("def sevens(completions, **kwargs):\n"
                                          "    return [float(str(c).count('7')) for c in completions]\n")
    data = a / "train.jsonl"
    # question/answer columns too: a resume that lost the file's reward_funcs trained on the numeric default
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "question": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                            for i in range(8)))
    (a / "grpo.yaml").write_text(textwrap.dedent(f'''
        model_name_or_path: {model}
        dataset_name: {data}
        reward_funcs: [rules60_rewards.sevens]
        output_dir: run
        max_steps: 1
        per_device_train_batch_size: 4
        num_generations: 4
        max_completion_length: 4
        report_to: none
        save_steps: 1
    '''))
    monkeypatch.chdir(a)
    rc, _, err = cli("train", "grpo.yaml", "--device", "cpu", "--parity_check_steps", "0", "--aqn", "false")
    assert rc == 0, err
    record = json.loads((a / "run" / "run_record.json").read_text())
    assert record["reward_funcs"] == [{"name": "rules60_rewards.sevens", "root": str(a.resolve())}]
    monkeypatch.chdir(b)
    rc, _, err = cli("train", "--resume", a / "run", "--max_steps", "2")
    assert rc == 0, err
    rows = [r for r in _metrics(a / "run") if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert "rewards/sevens/mean" in rows[-1], sorted(rows[-1])  # the run's own function, not a default reward


# ---- C: paths as users write them ----------------------------------------------------------------------
def test_a_tilde_in_a_yaml_output_dir_and_dataset_name_is_the_home_folder(cli, model, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    _rows(home / "d.jsonl")
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (work / "c.yaml").write_text(f"output_dir: ~/runs/x\ndataset_name: ~/d.jsonl\ndataset_config: {{eval_size: 4}}\n"
                                 f"model_name_or_path: {model}\n")
    args = train_args(model, "IGNORED", "--max_steps", "1")
    args = [work / "c.yaml"] + [a for a in args[1:] if a not in ("--output_dir", "IGNORED", "--model", model,
                                                                  "--dataset_name", "arithmetic", "--dataset_config",
                                                                  "{size: 16, eval_size: 4}")]
    rc, out, err = cli("train", *args)
    assert rc == 0, err
    assert (home / "runs" / "x" / "adapter").is_dir() and not (work / "~").exists()
    assert f"dataset_name: {home / 'd.jsonl'}" in (home / "runs" / "x" / "config.yaml").read_text()
    (work / "s.yaml").write_text("output_dir: ~/runs/s\n")  # the same normaliser for `qerl sft`
    rc, out, err = cli("sft", work / "s.yaml", *sft_args(model, "IGNORED")[1:-2])
    assert rc == 0 and (home / "runs" / "s" / "adapter").is_dir() and not (work / "~").exists(), err


@pytest.mark.parametrize("field", ["--model_name_or_path", "--output_dir", "--dataset_name"])
def test_a_dangling_link_is_named_before_the_model_loads(cli, model, tmp_path, field, no_model_load):
    link = tmp_path / ("gone.jsonl" if field == "--dataset_name" else "gone")
    link.symlink_to(tmp_path / "missing")
    extra = ["--dataset_config", "{}"] if field == "--dataset_name" else []
    rc, _, err = cli(*train_args(model, tmp_path / "run", field, link, *extra))
    assert rc == 2 and one_line(err), err
    assert f"config field '{field[2:]}': {link} is a link to {tmp_path / 'missing'}, which does not exist" in err, err


def test_an_output_name_past_the_file_systems_limit_is_named_before_the_model_loads(cli, model, tmp_path,
                                                                                    no_model_load):
    rc, _, err = cli(*sft_args(model, tmp_path / ("y" * 300)))
    assert rc == 2 and one_line(err) and "config field 'output_dir'" in err and "is 300 bytes" in err, err


def test_a_long_output_name_and_a_linked_output_folder_are_written_through(cli, model, tmp_path):
    """Regression guards: a 255-byte name (the limit) trains, and a linked output folder stays a link."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    for out in (tmp_path / ("z" * 255), tmp_path / "link"):
        rc, _, err = cli(*sft_args(model, out))
        assert rc == 0, err
    assert (tmp_path / "link").is_symlink() and (real / "adapter").is_dir()
