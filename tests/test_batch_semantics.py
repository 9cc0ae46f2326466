"""TRL's batch semantics (issue 21 §2): per_device_train_batch_size per rank, generation_batch_size
derived from the world size, and errors that name values that would split."""

import pytest
import torch
from safetensors.torch import load_file

from qerl.rl import GRPOConfig
from qerl.rl.batch_sizes import batch_plan
from qerl.rl.default_run import default_run_config
from test_distributed import _metrics, _run


def test_generation_batch_follows_trl_on_any_world_size():
    c = GRPOConfig()  # per_device 8, steps_per_generation unset (TRL: gradient_accumulation_steps, 1)
    for w in (1, 2, 4, 8):
        p = batch_plan(c, w)
        assert p.generation_batch_size == 8 * w and p.prompts_per_rank == 1 and p.updates_per_rank == 1
    p = batch_plan(GRPOConfig(gradient_accumulation_steps=4), 2)  # TRL: generation_batch_size 8 x 2 x 4
    assert p.generation_batch_size == 64 and p.updates_per_rank == 1
    run = default_run_config("cpu")  # the embedded run: one update a step of its accumulated micro-batches per rank
    b = run.per_device_train_batch_size * run.gradient_accumulation_steps
    assert [batch_plan(run, w).generation_batch_size for w in (1, 2, 4, 8)] == [b, 2 * b, 4 * b, 8 * b]
    assert all(batch_plan(run, w).updates_per_rank == 1 for w in (1, 2, 4, 8))
    assert batch_plan(GRPOConfig(steps_per_generation=2, gradient_accumulation_steps=2), 2).updates_per_rank == 1


def test_an_explicit_generation_batch_is_global():
    c = GRPOConfig(generation_batch_size=64, num_generations=4, per_device_train_batch_size=4)
    assert batch_plan(c, 1).steps_per_generation == 16 and batch_plan(c, 4).steps_per_generation == 4
    assert batch_plan(c, 4).prompts_per_rank == 4


@pytest.mark.parametrize("kw,world,fields,works", [
    # the case: 32 completions, micro-batch 32, 2 ranks
    (dict(generation_batch_size=32, per_device_train_batch_size=32, num_generations=2), 2,
     "generation_batch_size", ["generation_batch_size 64", "per_device_train_batch_size 16"]),
    (dict(generation_batch_size=48, per_device_train_batch_size=8), 4, "generation_batch_size",
     ["generation_batch_size 32 or 64"]),
    (dict(steps_per_generation=3, per_device_train_batch_size=4), 1, "steps_per_generation",
     ["steps_per_generation 2 or 4", "per_device_train_batch_size 8"]),
])
def test_a_batch_that_cannot_split_names_values_that_would(kw, world, fields, works):
    with pytest.raises(ValueError, match=f"config field '{fields}'") as e:
        batch_plan(GRPOConfig(**kw), world)
    for w in works:
        assert w in str(e.value)
        # and the named value does split
        name, val = w.split(" or ")[0].rsplit(" ", 1)
        c = GRPOConfig(**{**kw, name: int(val)})
        p = batch_plan(c, world)
        # whole groups and whole micro-batches on every rank, every micro-batch in a whole update
        assert p.prompts_per_rank * c.num_generations * world == p.generation_batch_size
        assert p.steps_per_generation * c.per_device_train_batch_size * world == p.generation_batch_size
        assert p.updates_per_rank * c.gradient_accumulation_steps == p.steps_per_generation >= 1


def test_both_sizes_set_must_agree():
    with pytest.raises(ValueError, match="disagree"):
        batch_plan(GRPOConfig(generation_batch_size=32, steps_per_generation=4, per_device_train_batch_size=8), 2)


def test_two_gloo_ranks_run_the_default_batch_settings(tmp_path):
    # no batch field set: 8 completions per micro-batch, one micro-batch per rank (TRL), so 2 ranks sample 16
    cfg = dict(max_steps=1, max_completion_length=8, max_prompt_length=64, aqn_stages=1, save_steps=1,
               optim="adamw_torch", ddp_timeout=120, dynamic_sampling=False)
    p, _ = _run(tmp_path, cfg, nproc=2)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (m,) = _metrics(tmp_path)
    assert m["world_size"] == 2 and m["updates"] == 1  # TRL's default: one update a generation
    assert m["completions"] == 8 * 2
    a, b = (load_file(str(tmp_path / f"adapter_rank{r}.safetensors")) for r in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_command_line_size_replaces_the_base_configs_other_size():
    run = default_run_config("cpu")  # sets steps_per_generation (= gradient_accumulation_steps: one update a step)
    assert batch_plan(run.with_overrides({"generation_batch_size": "128"}), 1).generation_batch_size == 128
    b, ga = run.per_device_train_batch_size, run.gradient_accumulation_steps
    assert batch_plan(run.with_overrides({"steps_per_generation": str(2 * ga)}), 2).generation_batch_size == b * 2 * 2 * ga
    with pytest.raises(ValueError, match="disagree"):  # both given at once must agree
        run.with_overrides({"steps_per_generation": str(2 * ga), "generation_batch_size": "32"})
