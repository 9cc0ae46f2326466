"""The qerl command line, run as a user runs it."""

import json
import subprocess
import sys

import pytest
from tiny_models import save_tiny


def qerl(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "qerl", *map(str, args)], capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"qerl {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def test_quantize_then_inspect_the_checkpoint(tmp_path):
    save_tiny(tmp_path / "dense", "llama")
    out = qerl("quantize", tmp_path / "dense", tmp_path / "ct", "--format", "nvfp4")
    assert "wrote nvfp4 checkpoint" in out.stdout
    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    rows = [json.loads(x) for x in qerl("inspect", tmp_path / "dense", "--quant", "mxfp4", "--json").stdout.splitlines()]
    assert len(rows) == 15 and rows[-1]["n_layers"] == 14
    assert all(0.02 < r["rel_error"] < 0.2 for r in rows[:-1])


def test_errors_are_one_clear_line(tmp_path):
    p = qerl("quantize", tmp_path / "nope", tmp_path / "out", check=False)
    assert p.returncode == 2
    assert "error:" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_main_job_inspects_smollm2():
    """The README's main-job command: SmolLM2 quantized to NVFP4 on the CPU, report per layer."""
    p = qerl("inspect")
    assert "model.layers.29.mlp.down_proj" in p.stdout
    ratio = float(p.stdout.split("linear weights")[1].split("(")[1].split("x")[0])
    assert 0.27 < ratio < 0.29  # 4.5 bits of 16 (+ the per-tensor scale)


def test_train_resume_and_plot(tmp_path):
    """qerl train on a tiny local model, --resume to a later max_steps, then qerl plot."""
    from tiny_models import tiny_tokenizer

    save_tiny(tmp_path / "m", "qwen2")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    run = tmp_path / "run"
    (tmp_path / "my.yaml").write_text("dataset_name: arithmetic\n")  # with a CONFIG, GRPOConfig's defaults apply
    common = ["--generation_batch_size", "8", "--num_generations", "4", "--per_device_train_batch_size", "8",
              "--max_completion_length", "8", "--lora_r", "4", "--report_to", "none", "--dataset_config",
              "{size: 20}"]
    out = qerl("train", tmp_path / "my.yaml", "--model_name_or_path", tmp_path / "m", "--output_dir", run, "--max_steps", "2",
               "--save_steps", "1", *common)
    assert "2 steps to step 2" in out.stdout
    assert (run / "checkpoint-2" / "trainer_state.json").exists() and (run / "adapter" / "adapter_config.json").exists()
    out = qerl("train", "--resume", run, "--max_steps", "3")
    assert "resuming" in out.stdout and "1 steps to step 3" in out.stdout
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # TRL's global_step, the resumed step's row written once
    png = qerl("plot", run).stdout.strip()
    assert png.endswith("curves.png") and (run / "curves.png").stat().st_size > 10_000
    bad = qerl("train", "--learning_rat", "1e-5", check=False)
    assert bad.returncode == 2 and "did you mean '--learning_rate'" in bad.stderr


@pytest.mark.slow
def test_the_default_run_cut_short_writes_finite_metrics_and_curves(tmp_path):
    """`qerl train` with no arguments is the embedded default run; here cut to 2 steps and 8
    held-out problems and 16 new tokens (CI): evaluations before and after, finite metrics, the summary, the PNG."""
    import math

    run = tmp_path / "run"
    out = qerl("train", "--output_dir", run, "--max_steps", "2", "--aqn_stages", "2", "--eval_limit", "8",
               "--eval_num_samples", "1", "--generation_batch_size", "16", "--per_device_train_batch_size", "16",
               "--max_completion_length", "16", "--device", "cpu")
    assert "| before | 0 |" in out.stdout and "| after | 2 |" in out.stdout and "change" in out.stdout
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
    assert [r["step"] for r in rows if "eval_pass_at_1" in r] == [0, 2]
    for r in rows:
        for k, v in r.items():
            assert v is not None and (not isinstance(v, float) or math.isfinite(v)), (k, v)
    assert rows[1]["sigma"] == 0 and rows[2]["sigma"] > 0  # AQN: stage 0 clean, then noise
    assert (run / "curves.png").stat().st_size > 10_000 and (run / "adapter" / "adapter_model.safetensors").exists()
    rep = json.loads((run / "eval" / "step_2.json").read_text())
    assert rep["dataset"] == "reasoning_gym/chain_sum" and rep["problems"] == 8


def test_generate_json_lines(tmp_path):
    save_tiny(tmp_path / "m", "qwen2")
    tiny_tok = __import__("tiny_models").tiny_tokenizer()
    tiny_tok.save_pretrained(tmp_path / "m")
    out = qerl("generate", tmp_path / "m", "--prompt", "hi", "--prompt", "ho", "--n", "2", "--max-new-tokens", "4",
               "--seed", "0", "--json")
    rows = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(1 <= len(r["token_ids"]) <= 4 and len(r["logprobs"]) == len(r["token_ids"]) for r in rows)
