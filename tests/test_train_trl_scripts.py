"""TRL's documented GRPO scripts (issue 41), each run under TRL 1.16 itself and under qerl.trl with only the
import line changed; the same assertions hold for both runs: trainer.state and its log_history with TRL's
metric names, the values of those metrics against what the reward functions returned, reward functions
getting trainer_state / log_metric, a reward returning None where it does not apply, callbacks called,
save_strategy="no" writing no checkpoint. Tiny random model on the CPU, 2 steps each."""

import math
import textwrap

import pytest


pytest.importorskip("trl")

STEPS = 2

# TRL's quickstart form: extra columns reach the rewards, several rewards weighted, one that applies only to
# some rows (None elsewhere), reward functions reading trainer_state and logging a metric, a callback
STANDARD = textwrap.dedent('''
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    calls = []

    def reward_len(completions, ground_truth, trainer_state, log_metric, **kwargs):
        vals = [-abs(len(g) - len(c)) / 10 for c, g in zip(completions, ground_truth)]
        log_metric("my_len_metric", sum(vals) / len(vals))
        calls.append(("reward_len", trainer_state.global_step, vals))
        return vals

    def reward_math_only(completions, task, trainer_state, **kwargs):
        vals = [float(len(c) % 3) if t == "math" else None for c, t in zip(completions, task)]
        calls.append(("reward_math_only", trainer_state.global_step, vals))
        return vals

    class Recorder(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_train_begin(self, args, state, control, **kw):
            self.events.append(("begin", state.global_step))

        def on_step_end(self, args, state, control, **kw):
            self.events.append(("step_end", state.global_step))

        def on_log(self, args, state, control, logs=None, **kw):
            self.events.append(("log", dict(logs)))

        def on_train_end(self, args, state, control, **kw):
            self.events.append(("end", state.global_step))

    recorder = Recorder()
    dataset = Dataset.from_list([{"prompt": f"{a}+{a}=", "ground_truth": "x" * (a + 2),
                                  "task": "math" if a % 2 else "chat"} for a in range(6)])
    args = GRPOConfig(output_dir=OUT, max_steps=STEPS, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, learning_rate=1e-3, logging_steps=1, report_to="none",
                      save_strategy="no", reward_weights=[1.0, 0.5], beta=0.04, use_cpu=True, bf16=False, seed=3)
    trainer = GRPOTrainer(model=MODEL, reward_funcs=[reward_len, reward_math_only], args=args,
                          train_dataset=dataset, callbacks=[recorder])
    trainer.train()
    history = trainer.state.log_history
''')

# conversational prompts, a model object with its processing_class, a peft_config
CONVERSATIONAL = textwrap.dedent('''
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    calls = []

    def reward_chars(completions, **kwargs):
        vals = [float(len(c[0]["content"])) for c in completions]
        calls.append(("reward_chars", kwargs["trainer_state"].global_step, vals))
        return vals

    model = AutoModelForCausalLM.from_pretrained(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"count to {a}"}]} for a in range(4)])
    args = GRPOConfig(output_dir=OUT, max_steps=STEPS, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=5, learning_rate=1e-3, logging_steps=1, report_to="none",
                      save_strategy="no", use_cpu=True, bf16=False)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=reward_chars, args=args,
                          train_dataset=dataset, peft_config=LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                                       target_modules=["q_proj", "v_proj"]))
    trainer.train()
    history = trainer.state.log_history
''')

# the names of TRL's GRPOTrainer metrics that a user's dashboards read (issue 41), for these configs on the CPU
TRL_NAMES = ("reward", "reward_std", "completions/mean_length", "completions/max_length", "completions/min_length",
             "completions/clipped_ratio", "completions/mean_terminated_length", "frac_reward_zero_std", "entropy",
             "num_tokens", "learning_rate", "grad_norm", "loss", "clip_ratio/region_mean", "clip_ratio/low_mean",
             "clip_ratio/high_mean", "epoch")



def run(script: str, under: str, out, model_dir) -> dict:
    code = script if under == "trl" else script.replace("from trl import", "from qerl.trl import")
    assert under == "trl" or code.count("qerl") == 1  # the import line is all that changes
    env = {"OUT": str(out), "MODEL": str(model_dir), "STEPS": STEPS}
    exec(compile(code, f"{under}_script.py", "exec"), env)  # noqa: S102 - the script under test
    mod = type(env["trainer"]).__module__
    assert mod.startswith("trl.") if under == "trl" else mod.startswith("qerl.")
    return env


def step_entries(history: list[dict]) -> list[dict]:
    return [h for h in history if "reward" in h]


def nanmean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else math.nan


def values_at(calls, name, step):
    """Every value the reward function `name` returned while trainer_state.global_step was `step`."""
    return [v for n, s, vals in calls if n == name and s == step for v in vals]


@pytest.mark.parametrize("under", ["trl", "qerl"])
def test_the_standard_script(tmp_path, model_dir, under):
    env = run(STANDARD, under, tmp_path / "run", model_dir)
    tr, history, calls = env["trainer"], env["history"], env["calls"]
    assert tr.state.global_step == STEPS
    steps = step_entries(history)
    assert [h["step"] for h in steps] == list(range(1, STEPS + 1))
    for name in TRL_NAMES + ("kl", "rewards/reward_len/mean", "rewards/reward_len/std",
                             "rewards/reward_math_only/mean", "rewards/reward_math_only/std", "my_len_metric"):
        assert all(name in h for h in steps), (name, sorted(steps[0]))
    assert "train_runtime" in history[-1] and history[-1]["step"] == STEPS  # transformers' summary entry
    for i, h in enumerate(steps):
        # rewards were called with the state of the step they score (global_step: steps done before it)
        ln, mo = values_at(calls, "reward_len", i), values_at(calls, "reward_math_only", i)
        assert ln and len(ln) == len(mo)
        assert h["rewards/reward_len/mean"] == pytest.approx(nanmean(ln), abs=1e-5)
        # None means "does not apply": left out of the function's mean, 0 in the weighted total
        want = nanmean(mo)
        if math.isnan(want):  # logged as None, as TRL logs a mean over nothing
            assert h["rewards/reward_math_only/mean"] is None
        else:
            assert h["rewards/reward_math_only/mean"] == pytest.approx(want, abs=1e-5)
        total = [a + 0.5 * (b or 0.0) for a, b in zip(ln, mo)]
        assert h["reward"] == pytest.approx(sum(total) / len(total), abs=1e-5)
        assert h["my_len_metric"] == pytest.approx(sum(ln) / len(ln), abs=1e-5)  # log_metric: the step's mean
        assert 0 < h["completions/mean_length"] <= h["completions/max_length"] <= 6
        assert 0 <= h["frac_reward_zero_std"] <= 1 and h["learning_rate"] > 0 and math.isfinite(h["kl"])
    assert steps[1]["num_tokens"] > steps[0]["num_tokens"] > 0  # cumulative, as TRL's
    returned = [v for n, _, vals in calls if n == "reward_math_only" for v in vals]
    assert None in returned and any(v is not None for v in returned)  # the run met both kinds of rows
    ev = env["recorder"].events
    assert ev[0] == ("begin", 0) and ev[-1] == ("end", STEPS)
    assert [s for e, s in ev if e == "step_end"] == list(range(1, STEPS + 1))
    logged = [x for e, x in ev if e == "log" and "reward" in x]
    assert len(logged) == STEPS and logged[0]["reward"] == steps[0]["reward"]
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # save_strategy="no"


@pytest.mark.parametrize("under", ["trl", "qerl"])
def test_the_conversational_script_with_a_model_object_and_peft_config(tmp_path, model_dir, under):
    env = run(CONVERSATIONAL, under, tmp_path / "run", model_dir)
    tr, calls = env["trainer"], env["calls"]
    assert tr.state.global_step == STEPS
    steps = step_entries(env["history"])
    assert len(steps) == STEPS
    for i, h in enumerate(steps):
        assert all(name in h for name in TRL_NAMES + ("rewards/reward_chars/mean",)), [n for n in TRL_NAMES if n not in h]
        assert h["rewards/reward_chars/mean"] == pytest.approx(nanmean(values_at(calls, "reward_chars", i)), abs=1e-5)
    assert not list((tmp_path / "run").glob("checkpoint-*"))
    if under == "qerl":
        assert tr.cfg.lora_r == 4 and sorted(tr.cfg.lora_target_modules) == ["q_proj", "v_proj"]
