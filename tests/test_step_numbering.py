"""One step numbering everywhere (issue 49): TRL's global_step, optimizer steps so far, 1 after the first, in
the printed lines, metrics.jsonl, trainer.state.log_history, the progress bar and the plot; run folders
written before (step rows from 0) read in the same numbering; run_name reaches the trackers; the time-left
estimate after the first step."""

import json

import pytest



def _old_folder(d, n=3):
    """A run folder as qerl wrote it before: step rows 0..n-1, evaluations at 0 and n."""
    d.mkdir(parents=True)
    rows = [{"step": 0, "eval_pass_at_1": 0.1, "eval_stderr": 0.01}]
    rows += [{"step": s, "reward_mean": 0.1 * s, "aqn_stage": 0, "sigma": 0.0, "time_step": 1.0} for s in range(n)]
    rows.append({"step": n, "eval_pass_at_1": 0.3, "eval_stderr": 0.01})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_an_old_folder_reads_in_global_steps_and_a_new_one_as_written(tmp_path):
    from qerl.train.metrics import read_metrics

    old = _old_folder(tmp_path / "old")
    got = read_metrics(tmp_path / "old")
    assert [r["step"] for r in got if "time_step" in r] == [1, 2, 3]  # each step row: the steps done after it
    assert [r["step"] for r in got if "eval_pass_at_1" in r] == [0, 3]  # the last step's row and its evaluation
    assert [r["reward_mean"] for r in got if "time_step" in r] == [r["reward_mean"] for r in old if "time_step" in r]
    new = tmp_path / "new"
    new.mkdir()
    rows = [{"step": s, "time_step": 1.0} for s in (1, 2)] + [{"step": 2, "eval_pass_at_1": 0.5}]
    (new / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_metrics(new) == rows
    # the TRL surface's rows of before kept TRL's count beside qerl's: that count is the step
    trl = tmp_path / "trl"
    trl.mkdir()
    (trl / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "global_step": 2 * s + 2, "time_step": 1.0})
                                               + "\n" for s in (0, 1)))
    assert [r["step"] for r in read_metrics(trl)] == [2, 4]


def test_resuming_an_old_folder_keeps_its_rows_to_the_checkpoint_in_the_new_numbering(tmp_path):
    from qerl.train.metrics import MetricsLog, read_rows

    _old_folder(tmp_path / "run", n=5)  # killed after 5 steps; its last checkpoint at step 2
    MetricsLog(tmp_path / "run", report_to="none", resume_step=2).close()
    kept = read_rows(tmp_path / "run" / "metrics.jsonl")
    assert [(r["step"], "time_step" in r) for r in kept] == [(0, False), (1, True), (2, True)]
    raw = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert raw == [0, 1, 2]  # rewritten: the resumed run appends 3, 4, 5 after them


def test_the_plot_of_an_old_folder_draws_its_steps_where_a_new_run_would(tmp_path):
    pytest.importorskip("matplotlib")
    from qerl.cli.plot import figure
    from qerl.train.metrics import read_metrics

    _old_folder(tmp_path / "old")
    fig = figure(read_metrics(tmp_path / "old"))
    (ax,) = [a for a in fig.axes if a.get_title() == "training reward"]
    assert list(ax.get_lines()[0].get_xdata()) == [1, 2, 3]
    (ev,) = [a for a in fig.axes if a.get_title().startswith("held-out pass@1")]
    assert [t.get_text() for t in ev.get_xticklabels()] == ["before\n(step 0)", "after\n(step 3)"]


# ---- the time-left estimate -------------------------------------------------------------------------


class FakeTime:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_time_left_leaves_the_first_step_s_one_off_costs_out():
    from qerl.train.eta import RunClock

    now = FakeTime()
    # a check at the start of steps 0 and 5 of 10 (every 5)
    clock = RunClock(10, {"time_parity": lambda done: len(range(-(-done // 5) * 5, 10, 5))}, now=now)
    clock.begin()
    now.t = 30.0  # the first step: 30 s, 20 of them the check
    left = clock.step_done(1, {"time_parity": 20.0, "time_step": 29.0})
    assert left.steps == 9 and left.per_step == pytest.approx(10.0)
    assert left.seconds == pytest.approx(9 * 10.0 + 20.0)  # nine steps and the check at step 5
    assert "took 30.0 s (20.0 s of it parity)" in left.line() and "estimated time left 01:50" in left.line()
    clock.begin()  # a later step's time runs from the last step's end (its checkpoint, evaluation counted)
    now.t = 36.0
    left = clock.step_done(2, {"time_step": 5.0})
    assert left.per_step == pytest.approx(6.0)  # the later steps only: the first paid warm-up too
    assert left.seconds == pytest.approx(8 * 6.0 + 20.0)
    for s in range(3, 6):
        now.t += 4.0
        left = clock.step_done(s, {"time_step": 4.0})
    assert left.per_step == pytest.approx((6.0 + 3 * 4.0) / 4) and left.seconds == pytest.approx(5 * 4.5 + 20.0)
    now.t += 24.0  # step 6 runs the check at step 5 (20 s): the last one
    left = clock.step_done(6, {"time_parity": 20.0, "time_step": 23.0})
    assert left.per_step == pytest.approx((6.0 + 4 * 4.0) / 5) and left.seconds == pytest.approx(4 * left.per_step)


# ---- a TRL script: num_iterations=2, every view numbered alike ---------------------------------------



def _grpo(model_dir, out, **kw):
    from qerl.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(**{**dict(output_dir=str(out), max_steps=4, num_iterations=2, per_device_train_batch_size=4,
                                num_generations=4, max_completion_length=4, learning_rate=1e-3, logging_steps=1,
                                report_to="none", save_steps=1, parity_check_steps=0), **kw})
    return GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                       args=args, train_dataset=[{"prompt": f"{a}+{a}="} for a in range(4)])


def test_every_view_numbers_steps_as_trl_s_global_step(tmp_path, model_dir, capsys, monkeypatch):
    from qerl.train import trackers

    names = []
    monkeypatch.setattr(trackers, "open_trackers", lambda kinds, out, config, name, resume_step=None:
                        names.append(name) or [])
    tr = _grpo(model_dir, tmp_path / "run", run_name="my-run")
    tr.train()
    out, err = capsys.readouterr()
    printed = [int(x.split()[0][5:]) for x in out.splitlines() if x.startswith("step=")]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    hist = [h for h in tr.state.log_history if "reward" in h]
    # two generations of two optimizer steps each: each view says 2 and 4
    assert printed == [r["step"] for r in rows] == [h["step"] for h in hist] == [2, 4]
    assert tr.state.global_step == tr.state.max_steps == 4 and tr.state.log_history[-1]["step"] == 4
    assert "4/4" in err and "1/4" not in err and "3/4" not in err  # the bar, in optimizer steps
    said = [x for x in out.splitlines() if "estimated time left" in x]
    assert len(said) == 1 and "(1 step x" in said[0]  # after the first generation: one left
    assert names == ["my-run"]  # run_name names the trackers' run
    # a resume keeps the rows to its checkpoint (global step 2) and numbers on from there
    tr = _grpo(model_dir, tmp_path / "run", max_steps=6, run_name=None)
    tr.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))  # global step 2
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6] and tr.state.global_step == 6
    assert [h["step"] for h in tr.state.log_history if "reward" in h] == [2, 4, 6]
    assert names[-1] is None  # unset: each tracker names the run itself, as transformers leaves it


def test_a_resume_keeps_the_checkpoint_s_own_point_in_the_trackers_as_in_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qerl.train.metrics import MetricsLog, read_rows

    run = tmp_path / "run"
    log = MetricsLog(run, report_to="tensorboard")
    for s in (1, 2, 3):  # killed after step 3; its checkpoint at step 2
        log.write({"step": s, "loss": 10.0 + s, "time_step": 1.0})
    log.close()
    time.sleep(1.1)  # TensorBoard orders event files by the second they were opened
    log = MetricsLog(run, report_to="tensorboard", resume_step=2)
    log.write({"step": 3, "loss": 3.0, "time_step": 1.0})  # the resumed run's step 3
    log.close()
    want = {1: 11.0, 2: 12.0, 3: 3.0}
    assert {r["step"]: r["loss"] for r in read_rows(run / "metrics.jsonl")} == want
    ea = EventAccumulator(str(run / "tensorboard"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("loss")] == list(want.items())


# ---- checkpoints and save_steps in global steps, as transformers' Trainer ---------------------------


def test_checkpoints_are_named_and_scheduled_in_global_steps(tmp_path, model_dir):
    """transformers names a checkpoint checkpoint-{global_step} and saves when global_step reaches a multiple of
    save_steps (and at the end); with num_iterations=2 a generation is two optimizer steps: global 2, 4, 6."""
    from qerl.train.checkpoints import checkpoints

    tr = _grpo(model_dir, tmp_path / "run", max_steps=6, save_steps=4)
    tr.train()
    assert [p.name for p in checkpoints(tmp_path / "run")] == ["checkpoint-4", "checkpoint-6"]
    st = json.loads((tmp_path / "run" / "checkpoint-4" / "trainer_state.json").read_text())
    assert st["global_step"] == 4
    # a resume from checkpoint-4 continues at global step 4
    tr = _grpo(model_dir, tmp_path / "run", max_steps=8, save_steps=4)
    tr.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert tr.state.global_step == 8
    assert [p.name for p in checkpoints(tmp_path / "run")][-1] == "checkpoint-8"
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6, 8]


def test_a_run_folder_whose_checkpoints_are_named_by_generation_still_resumes(tmp_path, model_dir):
    """Folders written before named a checkpoint by qerl's step (generations): checkpoint-2 held global step 4.
    Its state's step is what a resume reads, so it continues at global step 4."""
    tr = _grpo(model_dir, tmp_path / "run", max_steps=4, save_steps=4)
    tr.train()
    (tmp_path / "run" / "checkpoint-4").rename(tmp_path / "run" / "checkpoint-2")  # the old name
    tr = _grpo(model_dir, tmp_path / "run", max_steps=6, save_steps=4)
    tr.train(resume_from_checkpoint=True)
    assert tr.state.global_step == 6 and tr.step == 3
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 4, 6]
    assert (tmp_path / "run" / "checkpoint-6").is_dir()


def test_sft_eval_steps_as_a_fraction_of_the_run_is_transformers_reading(tmp_path, model_dir):
    """transformers reads eval_steps < 1 as a fraction of max_steps (ceil): 0.5 of 4 steps evaluates at 2 and 4."""
    pytest.importorskip("peft")
    from qerl.trl import SFTConfig, SFTTrainer

    data = [{"text": f"{a} plus {a} is {a + a}."} for a in range(4)]
    args = SFTConfig(output_dir=str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
                     report_to="none", save_strategy="no", max_length=48, eval_strategy="steps", eval_steps=0.5)
    tr = SFTTrainer(model=str(model_dir), args=args, train_dataset=data, eval_dataset=data)
    tr.train()
    assert [h["step"] for h in tr.state.log_history if "eval_loss" in h] == [2, 4]


# ---- run_name from a `trl grpo --config` / `trl sft --config` file ------------------------------------


def _tracker_names(monkeypatch):
    from qerl.train import trackers

    names = []
    monkeypatch.setattr(trackers, "open_trackers", lambda kinds, out, config, name, resume_step=None:
                        names.append(name) or [])
    return names


def test_run_name_in_a_trl_grpo_config_file_names_the_trackers_run(cli, tmp_path, model_dir, monkeypatch):
    names = _tracker_names(monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "lengths.py").write_text("def chars(completions, **kwargs):\n    return [float(len(c)) for c in "
                                         "completions]\n")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(4)))
    (tmp_path / "grpo.yaml").write_text(
        f"model_name_or_path: {model_dir}\ndataset_name: {tmp_path / 'train.jsonl'}\nreward_funcs: [lengths.chars]\n"
        f"output_dir: {tmp_path / 'run'}\nrun_name: my-grpo-run\nmax_steps: 1\nper_device_train_batch_size: 4\n"
        "num_generations: 4\nmax_completion_length: 4\nreport_to: none\nsave_strategy: 'no'\n")
    rc, out, err = cli("train", tmp_path / "grpo.yaml", "--device", "cpu", "--parity_check_steps", "0")
    assert rc == 0, err
    assert names == ["my-grpo-run"]
    assert not [x for x in out.splitlines() if "ignored" in x and "run_name" in x]  # not among the ignored fields


def test_run_name_in_a_trl_sft_config_file_names_the_trackers_run(cli, tmp_path, model_dir, monkeypatch):
    names = _tracker_names(monkeypatch)
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"text": f"{a} plus {a} is {a + a}."}) + "\n"
                                                for a in range(4)))
    (tmp_path / "sft.yaml").write_text(
        f"model_name_or_path: {model_dir}\ndataset_name: {tmp_path / 'sft.jsonl'}\noutput_dir: {tmp_path / 'run'}\n"
        "run_name: my-sft-run\nmax_steps: 1\nper_device_train_batch_size: 2\nmax_length: 48\nreport_to: none\n"
        "save_strategy: 'no'\n")
    rc, out, err = cli("sft", tmp_path / "sft.yaml", "--device", "cpu")
    assert rc == 0, err
    assert names == ["my-sft-run"]
    # unset: the output folder's name, as before
    rc, _, err = cli("sft", tmp_path / "sft.yaml", "--device", "cpu", "--run_name", "null", "--output_dir",
                     tmp_path / "run2")
    assert rc == 0, err
    assert names[-1] == "run2"
