"""TRL's names kept everywhere (issue 60): one rule for TRL's warm-up names (transformers 5's warmup_steps below 1
and transformers 4's warmup_ratio) in both TRL-style configs and in TRL config files, TRL's fields that qerl's own
configs lack sorted out alike in GRPOConfig and SFTConfig, use_peft: false said at start-up, one step numbering
(TRL's global_step) for TRL's inputs, no model copy left in $TMPDIR by qerl.trl, a model object's run named by the
model's name_or_path (not the copy), and a qerl.trl trainer without peft_config said to train LoRA, not every weight."""

import json
import tempfile

import pytest
import torch

from tiny_models import config as tiny_config, save_tiny, tiny_tokenizer


# ---- warm-up -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_qerl_s_own_configs_refuse_warmup_ratio_by_name_alike(kind):
    """SFTConfig(warmup_ratio=0.1) was a raw TypeError while GRPOConfig named warmup_steps."""
    from qerl.rl import GRPOConfig
    from qerl.sft import SFTConfig

    cls = {"sft": SFTConfig, "grpo": GRPOConfig}[kind]
    with pytest.raises(ValueError) as e:
        cls(warmup_ratio=0.1)
    assert "warmup_ratio=0.1" in str(e.value) and "warmup_steps" in str(e.value)
    assert "qerl.trl" in str(e.value)  # where the ratio is taken
    assert cls(warmup_ratio=0.0).warmup_steps == 0  # TRL's default changes nothing


def test_sft_config_sorts_out_trl_fields_as_grpo_config_does(capsys):
    from qerl.sft import SFTConfig

    cfg = SFTConfig(bf16=True, logging_first_step=True, learning_rate=3e-4)
    assert cfg.learning_rate == 3e-4
    assert "ignored: bf16, logging_first_step" in capsys.readouterr().out
    cfg = SFTConfig.from_dict({"bf16": True, "max_steps": 3}, source="f.yaml")
    assert cfg.max_steps == 3
    with pytest.raises(ValueError, match="f.yaml: neftune_noise_alpha=5"):
        SFTConfig.from_dict({"neftune_noise_alpha": 5}, source="f.yaml")


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_the_trl_configs_take_transformers_5_s_ratio_and_4_s_name_as_one_rule(kind, capsys, monkeypatch):
    from qerl.trl import GRPOConfig, SFTConfig
    from qerl.train import trl_fields as fields

    monkeypatch.setattr(fields, "_SAID", set())
    cls = {"sft": SFTConfig, "grpo": GRPOConfig}[kind]
    cfg = cls(warmup_steps=0.1)  # transformers 5: a float below 1 is the ratio (was "not an integer")
    assert cfg.trl.warmup_ratio == 0.1 and cfg.warmup_steps == 0
    assert cls(warmup_steps=3).warmup_steps == 3 and cls(warmup_steps=3).trl.warmup_ratio == 0
    capsys.readouterr()
    assert cls(warmup_ratio=0.2).trl.warmup_ratio == 0.2
    assert cls(warmup_ratio=0.3).trl.warmup_ratio == 0.3
    said = [x for x in capsys.readouterr().err.splitlines() if "deprecated" in x]
    assert len(said) == 1 and "warmup_steps=0.2" in said[0]  # said once a process
    with pytest.raises(ValueError, match="warmup_ratio=0.1 and warmup_steps=5 both set the warm-up; set one"):
        cls(warmup_ratio=0.1, warmup_steps=5)
    with pytest.raises(ValueError, match="warmup_ratio=1.5 must be a number from 0 to 1"):
        cls(warmup_ratio=1.5)


def test_a_trl_grpo_file_s_warmup_ratio_counts_its_max_steps(tmp_path):
    """qerl train of a `trl grpo --config` file refused warmup_ratio while qerl sft of a TRL file took it."""
    from qerl.cli.trl_config import split

    fields, rewards = split({"reward_funcs": ["m.f"], "max_steps": 10, "warmup_ratio": 0.25}, "g.yaml")
    assert fields["warmup_steps"] == 3 and "warmup_ratio" not in fields and rewards.names == ["m.f"]
    fields, _ = split({"reward_funcs": ["m.f"], "max_steps": 10, "warmup_steps": 0.1}, "g.yaml")
    assert fields["warmup_steps"] == 1
    with pytest.raises(ValueError, match=r"g.yaml: a warm-up ratio \(0.1 .*set max_steps there, or give warmup_steps"):
        split({"reward_funcs": ["m.f"], "warmup_ratio": 0.1}, "g.yaml")
    fields, _ = split({"reward_funcs": ["m.f"], "warmup_steps": 4}, "g.yaml")
    assert fields["warmup_steps"] == 4


def test_a_trl_sft_file_takes_warmup_steps_below_one_as_the_ratio(tmp_path):
    from qerl.trl.sft import trl_fields

    trl, rest = trl_fields({"warmup_steps": 0.1, "max_steps": 20}, source="s.yaml")
    assert trl.warmup_ratio == 0.1 and "warmup_steps" not in rest


# ---- use_peft ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", ["grpo", "sft", "trl_grpo", "trl_sft"])
def test_use_peft_false_is_said_at_start_up(make, capsys):
    """use_peft: false (TRL's full fine-tuning) was named as a field 'without an effect'."""
    from qerl.rl import GRPOConfig
    from qerl.sft import SFTConfig
    from qerl.trl import GRPOConfig as TG, SFTConfig as TS

    cls = {"grpo": GRPOConfig, "sft": SFTConfig, "trl_grpo": TG, "trl_sft": TS}[make]
    cls(use_peft=False)
    out = capsys.readouterr().out.splitlines()
    said = [x for x in out if "use_peft" in x]
    assert len(said) == 1 and "full fine-tuning" in said[0] and "not carried out" in said[0]
    assert "LoRA" in said[0] and "frozen 4-bit base" in said[0]
    cls(use_peft=True)  # what qerl does: named with the fields without an effect
    said = [x for x in capsys.readouterr().out.splitlines() if "use_peft" in x]
    assert len(said) == 1 and "ignored: use_peft" in said[0] and "full fine-tuning" not in said[0]


def test_a_trl_file_s_use_peft_false_is_said_under_qerl_train(tmp_path, capsys):
    from qerl.rl import GRPOConfig

    GRPOConfig.from_dict({"use_peft": False, "max_steps": 2}, source="g.yaml")
    said = [x for x in capsys.readouterr().out.splitlines() if "use_peft" in x]
    assert said and said[0].startswith("qerl: g.yaml: use_peft=False") and "full fine-tuning" in said[0]


# ---- one step numbering: TRL's global_step -----------------------------------------------------------

def _native(out, trainer_cls, **kw):
    from qerl.model import random_policy
    from qerl.rl import GRPOConfig
    from qerl.tasks import get_task

    torch.manual_seed(0)
    pol = random_policy(tiny_config("qwen2"), "nvfp4", lora_rank=8, device="cpu", dtype=torch.float32, std=0.05,
                        progress=False)
    pol.tokenizer = tiny_tokenizer()
    cfg = GRPOConfig(**{**dict(max_steps=2, generation_batch_size=8, num_generations=4, per_device_train_batch_size=4,
                               gradient_accumulation_steps=1, num_iterations=2, max_completion_length=4,
                               max_prompt_length=64, learning_rate=1e-2, aqn_stages=1, output_dir=str(out),
                               save_steps=1, report_to="none", eval_steps=0, eval_on_start=False,
                               eval_on_end=False, parity_check_steps=0, device="cpu"), **kw})
    return trainer_cls(cfg, policy=pol, task=get_task("arithmetic", size=20),
                       reward_funcs=[lambda completions, **_: [float(len(c)) for c in completions]], progress=False)


def test_a_trl_file_s_trainer_numbers_by_trl_s_global_step_and_the_native_one_by_generation(tmp_path):
    """Two generations of 2 micro-batches x 2 iterations = 4 optimizer steps each: TRL's numbering is 4, 8 in
    metrics.jsonl, trainer.state and the checkpoint folders; the native trainer keeps 1, 2 (its max_steps,
    save_steps and eval_steps count generations)."""
    from qerl.rl import GRPOTrainer
    from qerl.trl.steps import numbered_as_trl

    tr = _native(tmp_path / "trl", numbered_as_trl(GRPOTrainer))
    tr.train()
    rows = [json.loads(x) for x in (tmp_path / "trl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [4, 8]
    assert tr.state.global_step == 8 and tr.state.max_steps == 8
    assert sorted(p.name for p in (tmp_path / "trl").glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    tr = _native(tmp_path / "native", GRPOTrainer)
    tr.train()
    rows = [json.loads(x) for x in (tmp_path / "native" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]


def test_qerl_trl_and_a_trl_file_share_one_numbering_rule():
    from qerl.rl import GRPOTrainer as Native
    from qerl.trl import GRPOTrainer
    from qerl.trl.steps import TRLNumbering, numbered_as_trl

    assert issubclass(GRPOTrainer, TRLNumbering) and issubclass(numbered_as_trl(Native), Native)
    assert numbered_as_trl(GRPOTrainer) is GRPOTrainer


# ---- no model copy left in $TMPDIR -------------------------------------------------------------------

@pytest.fixture
def own_tmpdir(tmp_path, monkeypatch):
    d = tmp_path / "tmpdir"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


def _model_object(tmp_path):
    import transformers

    save_tiny(tmp_path / "m", "llama")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m"), transformers.AutoTokenizer.from_pretrained(
        tmp_path / "m")


def test_a_model_object_s_copy_is_removed_once_the_trainer_is_built(tmp_path, own_tmpdir):
    from qerl.trl import SFTConfig, SFTTrainer

    model, tok = _model_object(tmp_path)
    args = SFTConfig(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2, report_to="none")
    tr = SFTTrainer(model=model, args=args, processing_class=tok,
                    train_dataset=[{"text": "a b c d"}, {"text": "e f g h"}])
    assert list(own_tmpdir.iterdir()) == []  # was a full copy of the model, left for good
    tr.train()  # the policy was loaded: nothing needs the copy
    assert tr.step == 1 and list(own_tmpdir.iterdir()) == []
    assert json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == str(tmp_path / "m")  # the model given, not the temporary folder


@pytest.mark.parametrize("error", [KeyboardInterrupt, ValueError])
def test_a_model_object_s_copy_is_removed_when_the_build_fails_or_is_interrupted(tmp_path, own_tmpdir, monkeypatch,
                                                                                   error):
    from qerl.rl import GRPOTrainer as Native
    from qerl.trl import GRPOConfig, GRPOTrainer

    seen = []

    def stop(self, *a, **kw):
        seen.append(list(own_tmpdir.iterdir()))
        raise error("stop")

    monkeypatch.setattr(Native, "__init__", stop)
    model, tok = _model_object(tmp_path)
    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      report_to="none")
    with pytest.raises(error):
        GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                    processing_class=tok, train_dataset=[{"prompt": "1+1="}])
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].name.startswith("qerl_trl_model_")  # it was there
    assert list(own_tmpdir.iterdir()) == []


# ---- a model object: the run names the user's model; no peft_config: said at start-up -------------------

def test_a_model_object_s_run_names_the_model_not_its_temporary_copy(tmp_path, own_tmpdir, capsys):
    """config.yaml recorded the temporary copy's folder (gone once the trainer was built), so a resume or an
    export from the run's record named no model; it names the model's name_or_path and notes the objects."""
    import yaml

    from qerl.sft import SFTConfig as Native
    from qerl.trl import SFTConfig, SFTTrainer

    model, tok = _model_object(tmp_path)
    args = SFTConfig(output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=2, report_to="none")
    tr = SFTTrainer(model=model, args=args, processing_class=tok,
                    train_dataset=[{"text": "a b c d"}, {"text": "e f g h"}])
    tr.train()
    saved = tmp_path / "run" / "config.yaml"
    record = yaml.safe_load(saved.read_text())
    assert record["model_name_or_path"] == str(tmp_path / "m")
    assert record["in_memory"].startswith("model LlamaForCausalLM, processing_class ")
    capsys.readouterr()
    cfg = Native.from_yaml(saved)  # the record reads back (a resume): the note said, not a field
    assert cfg.model_name_or_path == str(tmp_path / "m")
    assert "in-memory objects" in capsys.readouterr().err
    note = [x for x in saved.read_text().splitlines() if "in-memory objects" in x or x.startswith("in_memory:")]
    assert len(note) == 2
    # a resume from the command line rewrites config.yaml: the note stays, once
    from qerl.cli import main

    assert main(["sft", "--resume", str(tmp_path / "run"), "--max_steps", "2"]) == 0
    assert [x for x in saved.read_text().splitlines() if "in-memory objects" in x or x.startswith("in_memory:")] \
        == note
    assert yaml.safe_load(saved.read_text())["max_steps"] == 2


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_a_qerl_trl_trainer_without_peft_config_says_it_trains_lora(tmp_path, model_dir, capsys, kind):
    """TRL fine-tunes every weight without a peft_config; qerl.trl trained LoRA on the frozen 4-bit base
    without a word. Said as a config's use_peft: false is (one rule, trl_fields.NOT_CARRIED_OUT)."""
    from qerl.trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    def build(**kw):
        if kind == "grpo":
            args = GRPOConfig(output_dir=str(tmp_path / "r"), max_steps=1, per_device_train_batch_size=4,
                              num_generations=4, report_to="none")
            return GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                               args=args, train_dataset=[{"prompt": "1+1="}], **kw)
        args = SFTConfig(output_dir=str(tmp_path / "r"), max_steps=1, per_device_train_batch_size=2)
        return SFTTrainer(model=str(model_dir), args=args, train_dataset=[{"text": "a b"}, {"text": "c d"}], **kw)

    build()
    said = [x for x in capsys.readouterr().out.splitlines() if "full fine-tuning" in x]
    name = {"grpo": "GRPOTrainer", "sft": "SFTTrainer"}[kind]
    assert len(said) == 1 and said[0].startswith(f"qerl: {name}: peft_config=None (TRL's default: full fine-tuning")
    assert "LoRA" in said[0] and "frozen 4-bit base" in said[0] and "peft_config=LoraConfig" in said[0]
    build(peft_config={"r": 8, "lora_alpha": 16})
    assert "full fine-tuning" not in capsys.readouterr().out


def test_a_run_folder_with_qerl_trls_in_memory_note_is_still_known_as_its_commands(tmp_path):
    """The note is no config field: `qerl sft --resume` of such a GRPO run must still say it is a `qerl train`
    run (run_kind), not fail on an unknown field."""
    from qerl.cli.run_config import run_kind
    from qerl.rl.config import GRPOConfig
    from qerl.train.trl_fields import IN_MEMORY

    (tmp_path / "config.yaml").write_text(GRPOConfig().to_yaml() + f"{IN_MEMORY}: model LlamaForCausalLM\n")
    assert run_kind(tmp_path) == "train"
