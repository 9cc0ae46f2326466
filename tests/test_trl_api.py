"""TRL's API over qerl (issue 33): a TRL script runs with only its import line changed, and a TRL config
file (TRL's names, TRL-only engine/logging fields) loads and trains one step. Tiny offline model."""

import json
import textwrap

import pytest
import torch

from qerl.rl import GRPOConfig
from tiny_models import save_tiny, tiny_tokenizer

SCRIPT = textwrap.dedent('''
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def reward_len(completions, **kwargs):
        return [-abs(8 - len(c)) for c in completions]

    dataset = Dataset.from_list([{"prompt": f"{a}+{a}="} for a in range(6)])
    args = GRPOConfig(output_dir=OUT, max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, learning_rate=1e-3, logging_steps=1, report_to="none",
                      save_strategy="no", use_cpu=True, bf16=False, vllm_importance_sampling_mode="token_truncate")
    trainer = GRPOTrainer(model=MODEL, reward_funcs=reward_len, args=args, train_dataset=dataset)
    trainer.train()
''')


@pytest.fixture
def model_dir(tmp_path):
    save_tiny(tmp_path / "model", "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_a_trl_script_runs_with_its_import_line_changed(tmp_path, model_dir):
    code = SCRIPT.replace("from trl import", "from qerl.trl import")
    assert code.count("qerl") == 1  # nothing else changed
    env = {"OUT": str(tmp_path / "run"), "MODEL": str(model_dir)}
    exec(compile(code, "trl_script.py", "exec"), env)  # noqa: S102 - the script under test
    tr = env["trainer"]
    assert tr.step == 1 and tr.cfg.importance_sampling_mode == "token_truncate"
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "completions" in r]
    assert len(steps) == 1 and steps[0]["completions"] > 0
    out = tr.save_model(str(tmp_path / "adapter"))
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()


def test_the_script_is_a_trl_script(tmp_path, model_dir):
    """The unchanged script runs under TRL itself (so the test above does not test a qerl dialect)."""
    pytest.importorskip("trl")
    env = {"OUT": str(tmp_path / "trl_run"), "MODEL": str(model_dir)}
    exec(compile(SCRIPT, "trl_script.py", "exec"), env)  # noqa: S102
    assert type(env["trainer"]).__module__.startswith("trl.") and env["trainer"].state.global_step == 1


def test_without_max_steps_it_trains_num_train_epochs_over_the_prompts_as_trl(tmp_path, model_dir):
    from qerl.trl import GRPOConfig as TRLStyleConfig, GRPOTrainer

    args = TRLStyleConfig(output_dir=str(tmp_path / "r"), per_device_train_batch_size=4, num_generations=4,
                          steps_per_generation=1, num_train_epochs=2, report_to="none")
    rows = [{"prompt": f"{a}="} for a in range(5)]
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                     args=args, train_dataset=rows)
    assert tr.cfg.max_steps == 10  # 2 passes x 5 prompts, one prompt (4 completions) a step


def test_conversational_prompts_give_reward_functions_messages_as_trl(tmp_path, model_dir):
    from qerl.trl import GRPOConfig as TRLStyleConfig, GRPOTrainer

    seen = []

    def reward(completions, **_):
        seen.extend(completions)
        return [float(len(c[0]["content"])) for c in completions]

    args = TRLStyleConfig(output_dir=str(tmp_path / "r"), max_steps=1, per_device_train_batch_size=4,
                          num_generations=4, steps_per_generation=1, max_completion_length=4, report_to="none")
    rows = [{"prompt": [{"role": "user", "content": "hi"}]}]
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=[reward], args=args, train_dataset=rows)
    tr.tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tr.train()
    assert seen and all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in seen)


TRL_YAML = '''
# a config written for `trl grpo --config`: TRL's names, TRL-only fields, a local dataset
model_name_or_path: {model}
torch_dtype: float32
use_peft: true
lora_r: 8
lora_alpha: 16
lora_target_modules: [q_proj, k_proj, v_proj, o_proj]
dataset_name: {data}
output_dir: {out}
bf16: false
use_vllm: false
vllm_mode: colocate
learning_rate: 1.0e-5
lr_scheduler_type: cosine
warmup_ratio: 0.0
per_device_train_batch_size: 4
gradient_accumulation_steps: 1
num_generations: 4
max_completion_length: 6
max_steps: 1
logging_steps: 1
report_to: none
save_strategy: "no"
push_to_hub: false
loss_type: dapo
beta: 0.01
scale_rewards: false
entropy_coeff: 0.001
vllm_importance_sampling_correction: true
vllm_importance_sampling_mode: sequence_truncate
vllm_importance_sampling_clip_max: 2.0
'''


def test_a_trl_config_file_loads_and_trains_one_step(tmp_path, model_dir, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(8)))
    path = tmp_path / "trl.yaml"
    path.write_text(TRL_YAML.format(model=model_dir, data=data, out=tmp_path / "run"))
    cfg = GRPOConfig.from_yaml(path)
    # save_strategy is honoured since issue 41 (no longer among the ignored fields)
    assert "ignored: use_peft, bf16, use_vllm, vllm_mode, push_to_hub" in capsys.readouterr().out
    assert cfg.save_strategy == "no"
    assert (cfg.importance_sampling_correction, cfg.importance_sampling_mode, cfg.importance_sampling_cap) == \
        (True, "sequence_truncate", 2.0)
    assert (cfg.scale_rewards, cfg.entropy_coef, cfg.dtype, cfg.lora_r) == ("none", 0.001, "float32", 8)
    from qerl.rl import GRPOTrainer

    tr = GRPOTrainer(cfg, reward_funcs=[lambda completions, **_: [float(len(c)) for c in completions]],
                     progress=False)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    m = tr.train()[-1]
    assert tr.step == 1 and "kl" in m and "is_weight_mean" in m
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters() if p.requires_grad)


def test_trl_fields_that_change_training_are_refused_unless_at_trls_default(tmp_path):
    GRPOConfig.from_dict({"use_adaptive_entropy": False, "multi_objective_aggregation": "sum_then_normalize"})
    with pytest.raises(ValueError, match="use_adaptive_entropy.*not implemented in qerl"):
        GRPOConfig.from_dict({"use_adaptive_entropy": True})
    with pytest.raises(ValueError, match="did you mean 'learning_rate'"):
        GRPOConfig.from_dict({"learning_rat": 1e-5})  # a typo is still a typo
