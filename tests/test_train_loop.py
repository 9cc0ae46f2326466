"""The run loop both trainers share (train/loop.py), seen through SFT, whose steps are fastest: a resume that
falls back past a corrupt checkpoint and continues exactly, TrainerCallback controls (stop, save),
save_strategy "no", trainer.state across a resume, and one config base."""

import dataclasses
import json

import pytest
import torch
from transformers import TrainerCallback

from qerl.model import random_policy
from qerl.sft import SFTConfig, SFTTrainer
from qerl.train.config import TrainConfig
from tiny_models import config, tiny_tokenizer


def _rows(n=8):
    return [{"prompt": f"add {i} {i + 3}", "completion": f" = {2 * i + 3}"} for i in range(n)]


def _trainer(out, callbacks=None, **kw):
    pol = random_policy(config("qwen2"), "nvfp4", lora_rank=4, device="cpu", dtype=torch.float32, std=0.05,
                        progress=False)
    pol.tokenizer = tiny_tokenizer()
    base = dict(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2,
                report_to="none", device="cpu", save_steps=1, save_total_limit=None, logging_steps=1)
    return SFTTrainer(SFTConfig(**{**base, **kw}), policy=pol, train_dataset=_rows(), progress=False,
                      callbacks=callbacks)


def _trainable(tr):
    return {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}


def test_sft_resume_falls_back_past_a_corrupt_checkpoint_and_continues_exactly(tmp_path, capsys):
    torch.manual_seed(0)
    full = _trainer(tmp_path / "a")
    full_rows = full.train()
    torch.manual_seed(0)
    _trainer(tmp_path / "b").train(stop_after=3)
    f = tmp_path / "b" / "checkpoint-3" / "trainable.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # a disk that lost the newest checkpoint's tail
    again = _trainer(tmp_path / "b")
    assert again.resume() == 2
    assert "skipping checkpoint-3" in capsys.readouterr().out
    assert (tmp_path / "b" / "checkpoint-3.corrupt").is_dir() and not (tmp_path / "b" / "checkpoint-3").exists()
    rows = again.train()
    assert [r["loss"] for r in rows] == [r["loss"] for r in full_rows[2:]]
    a, b = _trainable(full), _trainable(again)
    assert all(torch.equal(a[n], b[n]) for n in a)
    # trainer.state: the history before the checkpoint comes back from metrics.jsonl, then this run's steps
    steps = [h for h in again.state.log_history if "loss" in h and "train_runtime" not in h]
    assert [h["step"] for h in steps] == [1, 2, 3, 4] and again.state.global_step == 4
    assert [h["loss"] for h in steps] == [r["loss"] for r in full_rows]
    assert [h["num_tokens"] for h in steps] == [r["num_tokens"] for r in full_rows]  # restored running count


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step, self.saved = step, []

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True

    def on_save(self, args, state, control, **kw):
        self.saved.append(state.global_step)


def test_a_callback_stops_the_run_with_a_checkpoint(tmp_path):
    cb = StopAt(2)
    tr = _trainer(tmp_path / "r", callbacks=[cb], save_steps=100)
    rows = tr.train()
    assert len(rows) == 2 and tr.step == 2 and tr.state.global_step == 2
    assert cb.saved == [2] and (tmp_path / "r" / "checkpoint-2").is_dir()
    assert (tmp_path / "r" / "adapter" / "adapter_model.safetensors").is_file()


class SaveAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 1:
            control.should_save = True


def test_save_strategy_no_writes_no_checkpoint_unless_a_callback_asks(tmp_path):
    tr = _trainer(tmp_path / "n", save_strategy="no")
    tr.train()
    assert not list((tmp_path / "n").glob("checkpoint-*")) and (tmp_path / "n" / "adapter").is_dir()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _trainer(tmp_path / "n", save_strategy="no").resume()
    tr = _trainer(tmp_path / "s", callbacks=[SaveAt], save_strategy="no")  # a class, as transformers takes
    tr.train()
    assert sorted(p.name for p in (tmp_path / "s").glob("checkpoint-*")) == ["checkpoint-1"]


def test_both_configs_share_one_base_and_its_checks():
    from qerl.rl import GRPOConfig

    base = {f.name for f in dataclasses.fields(TrainConfig)}
    for cls in (GRPOConfig, SFTConfig):
        assert issubclass(cls, TrainConfig) and base <= {f.name for f in dataclasses.fields(cls)}
        for bad, field in (({"save_strategy": "epoch"}, "save_strategy"), ({"report_to": "neptune"}, "report_to"),
                           ({"save_steps": 0}, "save_steps")):
            with pytest.raises(ValueError, match=field):
                cls(**bad)
    # SFT keeps its own defaults of shared fields; the new shared fields reach it (ranks' timeout)
    assert (SFTConfig().learning_rate, GRPOConfig().learning_rate) == (1e-4, 1e-5)
    assert SFTConfig(ddp_timeout=60).ddp_timeout == 60
    assert SFTConfig(report_to=[]).report_to == "none"  # TRL's list form


def test_metrics_rows_and_log_history_agree(tmp_path):
    tr = _trainer(tmp_path / "m", max_steps=2)
    tr.train()
    rows = [json.loads(x) for x in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    hist = [h for h in tr.state.log_history if "train_runtime" not in h]
    # one numbering: TRL's global_step, 1 after the first step, in metrics.jsonl and log_history alike
    assert [h["step"] for h in hist] == [r["step"] for r in rows] == [1, 2]
    for h, r in zip(hist, rows):
        assert h["loss"] == r["loss"] and h["learning_rate"] == r["lr"] and h["epoch"] == r["epoch"]
    summary = tr.state.log_history[-1]
    assert summary["step"] == 2 and summary["train_loss"] == pytest.approx(sum(r["loss"] for r in rows) / 2)
