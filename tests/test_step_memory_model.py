"""The MoE step's memory model (bench/step_plan.py): its terms against counts made here from the shapes,
and its predictions against the measured steps in benchmarks/results/step.jsonl."""

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from qerl.bench import memory as bmem
from qerl.bench.step_plan import (CALIBRATION, MOE_SHAPES, StepSettings, humming_copy_shapes, kv_slots, lora_bytes,
                                  model_memory, plan_step)
from qerl.rollout.kv_cache import bytes_per_slot

GIB = 2**30
STEP = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "step.jsonl"
QWEN = MOE_SHAPES["qwen3-30b-a3b"]


def _measured(case: str, metric: str, commit: str) -> float:
    rows = [json.loads(x) for x in STEP.read_text().splitlines() if x.strip()]
    hit = [r["value"] for r in rows if r["case"] == case and r["metric"] == metric and r["commit"] == commit]
    assert hit, (case, metric, commit)
    return hit[-1]


def test_weights_from_shapes():
    """NVFP4: 4-bit codes, an FP8 scale per 16 weights, a fp32 global scale per expert projection."""
    p = plan_step(QWEN)
    per_expert = sum(n * k // 2 + n * k // 16 + 4 for n, k in ((2 * 768, 2048), (2048, 768)))
    assert p.experts == 48 * 128 * per_expert
    assert p.dense == 2 * (2 * 151936 * 2048 + 48 * (128 * 2048 + 2 * 2048 + 2 * 128) + 2048)
    assert abs(p.experts / GIB - 15.1875) < 1e-3


def test_kv_cache_as_the_engine_sizes_it():
    """3.4 GiB of bf16 slots of 256 + 1 + 256 tokens: 72 fit, the step's 64 rows cap it (the engine's max_slots)."""
    view = SimpleNamespace(n_layers=48, n_kv=4, head_dim=128, dtype=torch.bfloat16)
    per = bytes_per_slot(view, 513)
    assert per == 48 * 2 * 4 * 128 * 513 * 2
    assert int(3.4 * GIB) // per == 72 and kv_slots(QWEN, StepSettings()) == 64
    assert plan_step(QWEN).kv_cache == 64 * per
    fp8 = replace(StepSettings(), kv_bytes=1, kv_cache_gb=0.8)
    assert plan_step(QWEN, fp8).kv_cache == kv_slots(QWEN, fp8) * bytes_per_slot(view, 513, "fp8")


def test_humming_copies_and_lora():
    """q|k|v fused (32 + 2 x 4 heads of 128 rows) and o take humming copies; gpt-oss's o (2880 rows) does not."""
    assert humming_copy_shapes(QWEN) == [(5120, 2048), (2048, 4096)]
    assert [s[0] for s in humming_copy_shapes(MOE_SHAPES["gpt-oss-120b"])] == [5120]
    assert plan_step(QWEN).kernel_copies == 48 * (5120 * 2048 + 2048 * 4096) * 9 // 16
    assert plan_step(QWEN, replace(StepSettings(), humming=False)).kernel_copies == 0
    one = plan_step(QWEN, replace(StepSettings(), humming_storage=True))  # humming's layout stored: no copies
    assert one.kernel_copies == 0 and one.attention == plan_step(QWEN).attention
    params = 48 * 32 * ((4096 + 2048) + 2 * (512 + 2048) + (2048 + 4096))
    assert lora_bytes(QWEN, StepSettings()) == params * 8  # bf16 factor, gradient and two AdamW moments


@pytest.mark.parametrize("shape,measured", [("qwen3-30b-a3b", 2.472458839416504), ("gpt-oss-120b", 8.536833763122559)])
def test_model_memory_of_the_4_layer_records(shape, measured):
    case = f"{shape} 4L nvfp4 8x8 prompt256 new16 mu1 mb2 ckpt adamw_torch"
    assert _measured(case, "model_memory", "e65a2ba") == pytest.approx(measured)
    assert model_memory(MOE_SHAPES[shape], 4) / GIB == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("shape,settings,case", [
    ("qwen3-30b-a3b", {}, CALIBRATION["case"]),
    ("gpt-oss-120b", {"new_tokens": 128, "kv_cache_gb": 2.6},
     "gpt-oss-120b nvfp4 8x8 prompt256 new128 mu1 mb2 ckpt kv2.6 adamw_torch")])
def test_prediction_within_5_percent_of_the_measured_step(shape, settings, case):
    p = plan_step(MOE_SHAPES[shape], replace(StepSettings(), **settings))
    for metric, got in (("peak_reserved", p.peak_reserved), ("peak_allocated", p.peak_allocated)):
        want = _measured(case, metric, "ed5e22d")
        assert abs(got / GIB / want - 1) <= 0.05, (metric, got / GIB, want)


def test_the_24gb_settings_are_predicted_under_22_gib():
    st = replace(StepSettings(), humming=False, kv_cache_gb=0.8, logprob_chunk=128)
    p = plan_step(QWEN, st)
    assert p.peak_reserved / GIB <= 22 and p.kv_slots == 17
    # every lever lowers the prediction from the measured settings
    assert p.peak_reserved < plan_step(QWEN).peak_reserved


def test_bench_memory_prints_the_step_for_given_settings(capsys):
    bmem.main(["--step-only", "--shape", "qwen3-30b-a3b", "--no-humming", "--kv-cache-gb", "0.8",
               "--logprob-chunk", "128"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "peak_reserved" in x)
    assert float(line.split()[4]) <= 22 and "gpt-oss" not in out
