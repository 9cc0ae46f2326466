"""`qerl train` of a `trl grpo --config` file numbers its steps as qerl.trl does for the same config (issue 60):
TRL's global_step, optimizer steps so far, in the printed lines, metrics.jsonl and checkpoint-N names, with
several updates a generation (num_iterations 2); its --max_steps counts optimizer steps, fresh or resumed; a
resume compares the run's checkpoints with its last step in that numbering (a finished run is said finished,
a max_steps below the run's step refused). Tiny model on the CPU, a few generations each."""

import json
import textwrap

import pytest

# the same config for both: max_steps 4 optimizer steps, 2 a generation (num_iterations 2, gradient accumulation 1)
FIELDS = dict(max_steps=4, num_iterations=2, per_device_train_batch_size=4, gradient_accumulation_steps=1,
              num_generations=4, max_completion_length=4, learning_rate=1.0e-3, logging_steps=1, save_steps=2,
              dynamic_sampling=False, aqn=False, parity_check_steps=0, report_to="none")
MODULE = "numbering60_rewards"  # a module name of its own: Python keeps the first module of a name it imported


@pytest.fixture(scope="module")
def rewards_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("rewards")
    (d / f"{MODULE}.py").write_text("def chars(completions, **kwargs):\n"
                                    "    return [float(len(c)) for c in completions]\n")
    return d


@pytest.fixture
def trl_file(tmp_path, model_dir, rewards_dir, monkeypatch):
    """A `trl grpo --config` file of FIELDS (its reward function beside the working folder, as TRL's script)."""
    monkeypatch.chdir(rewards_dir)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(4)))

    def write(**kw):
        f = {**FIELDS, **kw}
        body = "".join(f"{k}: {json.dumps(v)}\n" for k, v in f.items())
        (tmp_path / "grpo.yaml").write_text(textwrap.dedent(f'''
            model_name_or_path: {model_dir}
            dataset_name: {data}
            reward_funcs: [{MODULE}.chars]
            output_dir: {tmp_path / "run"}
        ''') + body)
        return tmp_path / "grpo.yaml"
    return write


def _steps(run):
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if "reward_mean" in json.loads(x)]


def _printed(out):
    return [int(x.split()[0][5:]) for x in out.splitlines() if x.startswith("step=")]


def _checkpoints(run):
    from qerl.train.checkpoints import checkpoints

    return [p.name for p in checkpoints(run)]


def test_a_trl_file_s_steps_are_numbered_as_qerl_trl_numbers_the_same_config(cli, trl_file, tmp_path, model_dir,
                                                                              capsys):
    rc, out, err = cli("train", trl_file(), "--device", "cpu")
    assert rc == 0, err
    run = tmp_path / "run"
    assert "by TRL's global_step, 1 to 4" in out  # the start line says the numbering
    assert _printed(out) == _steps(run) == [2, 4]
    assert _checkpoints(run) == ["checkpoint-2", "checkpoint-4"]
    assert "2 generations to step 4" in out
    state = json.loads((run / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4

    # qerl.trl, the same config and rows
    from qerl.trl import GRPOConfig, GRPOTrainer

    trl_run = tmp_path / "trl_run"
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                     args=GRPOConfig(output_dir=str(trl_run), **FIELDS),
                     train_dataset=[{"prompt": f"{a}+{a}="} for a in range(4)])
    tr.train()
    trl_out = capsys.readouterr().out
    assert _printed(trl_out) == _printed(out) and _steps(trl_run) == _steps(run)
    assert _checkpoints(trl_run) == _checkpoints(run)


def test_a_trl_file_s_run_resumes_finishes_and_refuses_in_its_own_numbering(cli, trl_file, tmp_path, monkeypatch):
    """checkpoint-4 is the end of a max_steps 4 run (2 generations): --resume says it is finished, without loading
    a model (it compared 4 with 2 generations before and trained again); --max_steps 2 (optimizer steps) is
    below it, refused by the same number."""
    run = tmp_path / "run"
    rc, _, err = cli("train", trl_file(), "--device", "cpu")
    assert rc == 0, err

    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("qerl.model.load_policy", refuse)
    monkeypatch.setattr("qerl.train.parts.load_policy", refuse, raising=False)
    before = (run / "metrics.jsonl").read_text()
    rc, out, err = cli("train", "--resume", run)
    assert rc == 0, err
    assert "is finished (step 4/4)" in out and "--max_steps N (N > 4)" in out, out
    assert (run / "metrics.jsonl").read_text() == before
    rc, _, err = cli("train", "--resume", run, "--max_steps", "2")
    assert rc == 2 and "is at step 4; max_steps 2 is below it" in err and "(N > 4)" in err, err


def test_resuming_a_trl_file_s_run_counts_max_steps_in_optimizer_steps(cli, trl_file, tmp_path):
    """--max_steps 8 on the resume of a run at global step 4: 2 more generations of 2 updates, to step 8."""
    run = tmp_path / "run"
    rc, _, err = cli("train", trl_file(), "--device", "cpu")
    assert rc == 0, err
    rc, out, err = cli("train", "--resume", run, "--max_steps", "8")
    assert rc == 0, err
    assert f"resuming {run} at step 4/8" in out, out
    assert _steps(run) == [2, 4, 6, 8] and _printed(out) == [6, 8]
    assert _checkpoints(run)[-1] == "checkpoint-8"
    assert "2 generations to step 8" in out


def test_max_steps_on_the_command_line_of_a_trl_file_counts_optimizer_steps(cli, trl_file, tmp_path):
    rc, out, err = cli("train", trl_file(max_steps=2), "--max_steps", "6", "--print_config")
    assert rc == 0, err
    assert "max_steps: 3\n" in out  # 3 generations of 2 updates: TRL's 6 optimizer steps
    assert "--max_steps: max_steps=6 counts TRL's optimizer steps" in err + out


def test_a_stopped_trl_file_run_says_its_step_in_its_numbering():
    from types import SimpleNamespace

    from qerl.cli.stopped_run import interrupted
    from qerl.cli.train import numbered

    trainer = SimpleNamespace(step=1, max_steps=2, global_step=2, global_max_steps=4)
    cfg = SimpleNamespace(output_dir="/nonexistent/run", max_steps=2)
    assert "at step 2/4" in interrupted(cfg, numbered(trainer), "SIGINT")
    assert "before training started" in interrupted(cfg, numbered(None), "SIGINT")
