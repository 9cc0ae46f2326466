"""Memory levers chosen from the free memory (train/levers.py): the activation estimate against the
bytes autograd really saves, the choices at both ends of the memory range, and the trainer's use.

The CPU's budget is MemAvailable, not MemFree (issue 40: the same config chose gradient checkpointing
off, then on, as the page cache filled)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import config

from qerl.model import qwen25_config, random_policy
from qerl.train import levers
from qerl.train.levers import available_ram, free_memory


def _saved_bytes(model, ids) -> int:
    """Bytes of the activations autograd keeps for a forward (weights and buffers excluded)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=ids)
    own = {p.untyped_storage().data_ptr() for p in model.parameters()} | \
        {b.untyped_storage().data_ptr() for b in model.buffers()}
    return sum(v for k, v in seen.items() if k not in own)


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_the_estimate_matches_what_autograd_saves(family):
    cfg = config(family)
    pol = random_policy(cfg, "nvfp4", lora_rank=8, device="cpu", dtype=torch.bfloat16, progress=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 192))
    real = _saved_bytes(pol.model, ids)
    est = levers.activation_bytes(levers.Shape.of(cfg), ids.numel(), checkpointing=False, chunk=0)
    assert 0.8 < real / est < 1.25, (real, est)


def test_a_big_card_keeps_activations_and_a_small_one_recomputes():
    shape = levers.Shape.of(qwen25_config("qwen2.5-7b"))
    tokens = 8 * (256 + 2048)  # a micro-batch of 8 completions of the 7B shape
    big = levers.choose(shape, tokens, 400 * 2**30, gradient_checkpointing=None, logprob_chunk_size=None)
    small = levers.choose(shape, tokens, 40 * 2**30, gradient_checkpointing=None, logprob_chunk_size=None)
    assert not big.gradient_checkpointing and small.gradient_checkpointing
    assert big.fits() and small.fits()
    assert big.logprob_chunk_size >= small.logprob_chunk_size
    for lv in (big, small):  # the chunk's fp32 logits stay within their share of the budget
        assert 3 * lv.logprob_chunk_size * shape.vocab * 4 <= levers.CHUNK_SHARE * lv.budget_bytes
    tiny = levers.choose(shape, tokens, 2 * 2**30, gradient_checkpointing=None, logprob_chunk_size=None)
    assert not tiny.fits() and "does NOT fit" in tiny.describe()


def test_settings_the_user_made_win():
    shape = levers.Shape.of(qwen25_config("qwen2.5-7b"))
    lv = levers.choose(shape, 4096, 10 * 2**30, gradient_checkpointing=False, logprob_chunk_size=512)
    assert (lv.gradient_checkpointing, lv.logprob_chunk_size, lv.chosen) == (False, 512, ())


def test_the_trainer_fills_unset_levers_and_prints_them(tmp_path, capsys):
    from test_trainer import _trainer

    tr = _trainer(tmp_path, max_steps=1)
    assert tr.cfg.gradient_checkpointing is False  # a tiny model on a machine with gigabytes free
    assert tr.cfg.logprob_chunk_size == tr.levers.logprob_chunk_size in levers.CHUNKS
    assert "chosen from memory" in capsys.readouterr().out
    tr2 = _trainer(tmp_path / "b", max_steps=1, logprob_chunk_size=300, gradient_checkpointing=True)
    assert (tr2.cfg.logprob_chunk_size, tr2.cfg.gradient_checkpointing) == (300, True)


def _meminfo(tmp_path, free_kb, available_kb):
    f = tmp_path / "meminfo"
    f.write_text(f"MemTotal:       16000000 kB\nMemFree:         {free_kb} kB\nMemAvailable:   {available_kb} kB\n"
                 "Buffers:           1000 kB\nCached:         9000000 kB\n")
    return str(f)


def test_the_budget_is_mem_available_whatever_the_page_cache_holds(tmp_path):
    # the same machine before and after reading 9 GB of files: MemFree drops, MemAvailable does not
    before = available_ram(_meminfo(tmp_path, 12_000_000, 12_500_000))
    after = available_ram(_meminfo(tmp_path, 3_000_000, 12_400_000))
    assert before == 12_500_000 * 1024 and after == 12_400_000 * 1024


def test_without_meminfo_it_falls_back_to_free_pages(tmp_path):
    import os

    got = available_ram(str(tmp_path / "none"))
    assert got > 0 and abs(got - os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) < 2 ** 30


def test_the_cpu_budget_reads_this_machines_mem_available_up_to_the_cap():
    from pathlib import Path

    text = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").is_file() else ""
    if "MemAvailable" not in text:
        return
    want = int(next(x for x in text.splitlines() if x.startswith("MemAvailable")).split()[1]) * 1024
    assert abs(free_memory("cpu") - min(want, levers.CPU_BUDGET)) < 2 ** 30  # read moments apart: within a GiB
