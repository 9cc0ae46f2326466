"""The default run in a laptop's memory (issue 50): the levers that cut its peak RSS change nothing it
computes. Smaller micro-batches accumulated into one optimizer update give the gradient of the whole
batch; a small logprob chunk gives the logprobs and gradients of one chunk over all tokens; the CPU's
update budget is capped; the fp32 estimate counts 4-byte activations."""

from __future__ import annotations

import pytest
import torch
from tiny_models import config, tiny_tokenizer

from qerl.model import random_policy
from qerl.rl import GRPOConfig, GRPOTrainer
from qerl.rl.batch_sizes import batch_plan
from qerl.rl.default_run import CPU, GPU, default_run_config
from qerl.tasks import get_task
from qerl.train import levers
from qerl.train.logprobs import completion_logprobs, pad_batch


def varied(completions, **_):
    return [sum(map(ord, c)) % 7 / 7 for c in completions]


def _trainer(out, **kw):
    torch.manual_seed(0)
    pol = random_policy(config("qwen2"), "nvfp4", lora_rank=8, device="cpu", dtype=torch.float32, std=0.05,
                        progress=False)
    pol.tokenizer = tiny_tokenizer()
    cfg = GRPOConfig(**{**dict(max_steps=2, generation_batch_size=16, num_generations=4, max_completion_length=12,
                               max_prompt_length=64, learning_rate=1e-2, aqn_stages=2, output_dir=str(out),
                               report_to="none", device="cpu", loss_type="dapo"), **kw})
    return GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=40), reward_funcs=[varied], progress=False)


def _first_update_grads(tr) -> tuple[list[torch.Tensor], dict]:
    """The gradients the first optimizer step sees, and the step's metrics."""
    seen = []
    step = tr.optimizer.step

    def record(*a, **k):
        if not seen:
            seen.extend(p.grad.detach().clone() for p in tr.params)
        return step(*a, **k)

    tr.optimizer.step = record
    return seen, tr.train_step()


def test_micro_batches_accumulated_into_one_update_give_the_whole_batchs_gradient(tmp_path):
    # the default run on the CPU trains 64 completions as 4 micro-batches of 16 in one update (not one of 64)
    whole = _trainer(tmp_path / "a", per_device_train_batch_size=16, gradient_accumulation_steps=1)
    split = _trainer(tmp_path / "b", per_device_train_batch_size=4, gradient_accumulation_steps=4)
    assert whole.plan.updates_per_rank == split.plan.updates_per_rank == 1
    g1, m1 = _first_update_grads(whole)
    g2, m2 = _first_update_grads(split)
    assert m1["completion_length_mean"] == m2["completion_length_mean"]  # the same rollouts
    assert any(float(g.abs().max()) > 0 for g in g1)  # a step that trains
    for a, b in zip(g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5 * float(a.abs().max()))  # float32 sums in another order
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-4, abs=1e-7)


def test_the_default_runs_batch_is_unchanged_and_one_update_a_step():
    for device in ("cpu", "cuda"):
        cfg = default_run_config(device)
        plan = batch_plan(cfg)
        want = 64 if device == "cpu" else 128
        assert (plan.generation_batch_size, plan.prompts_per_rank, plan.updates_per_rank) == (want, want // 8, 1)
    # the CPU's micro-batch is a quarter of the step's completions (its activations a quarter)
    assert CPU["per_device_train_batch_size"] * CPU["gradient_accumulation_steps"] == 64
    assert GPU["per_device_train_batch_size"] * GPU["gradient_accumulation_steps"] == 128
    # the planner chooses checkpointing on both; the GPU sizes its KV cache from the free memory
    gpu, cpu = default_run_config("cuda"), default_run_config("cpu")
    assert (gpu.gradient_checkpointing, cpu.gradient_checkpointing) == (None, None)
    assert (gpu.rollout_kv_cache_gb, gpu.gradient_accumulation_steps) == (None, 1)


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_a_small_logprob_chunk_gives_the_full_heads_logprobs_entropies_and_gradients(entropy_grad, temperature):
    torch.manual_seed(1)
    pol = random_policy(config("llama"), "nvfp4", lora_rank=8, device="cpu", dtype=torch.float32, std=0.05,
                        progress=False)
    m = pol.model
    prompts = [[3, 5, 7, 9, 11], [4, 6, 8]]
    comps = [list(range(20, 20 + n)) for n in (13, 7)]
    batch = pad_batch(prompts, comps)
    ids, att, pos, tg, mask = batch
    out = {}
    for chunk in (4096, 3):  # one chunk over all 20 tokens, and 7 chunks with a ragged last one
        m.zero_grad()
        lp, en = completion_logprobs(m, *batch, temperature=temperature, chunk=chunk, entropy_grad=entropy_grad)
        (lp.sum() + (en.sum() if entropy_grad else 0)).backward()
        out[chunk] = (lp.detach(), en.detach(), [p.grad.clone() for p in m.parameters() if p.requires_grad])
    # an independent reference: the full model's logits at the completion positions, through autograd
    m.zero_grad()
    logits = m(input_ids=ids, attention_mask=att).logits.float() / temperature
    lsm = logits[torch.arange(len(prompts))[:, None], pos].log_softmax(-1)
    ref = lsm.gather(-1, tg[..., None])[..., 0] * mask
    ref_en = -(lsm.exp() * lsm).sum(-1) * mask
    (ref.sum() + (ref_en.sum() if entropy_grad else 0)).backward()
    want = (ref.detach(), ref_en.detach(), [p.grad.clone() for p in m.parameters() if p.requires_grad])
    for lp_, en_, g_ in out.values():
        torch.testing.assert_close(lp_, want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(en_, want[1], rtol=1e-4, atol=1e-5)
        for a, b in zip(want[2], g_):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * float(a.abs().max()))  # fp32 sums in another order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_estimate_counts_the_models_activation_bytes(dtype):
    from test_levers import _saved_bytes

    cfg = config("llama")
    pol = random_policy(cfg, "nvfp4", lora_rank=8, device="cpu", dtype=dtype, progress=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 192))
    shape = levers.Shape.of(pol.model.config)  # a loaded model's config names its dtype
    assert shape.act_bytes == dtype.itemsize
    est = levers.activation_bytes(shape, ids.numel(), checkpointing=False, chunk=0)
    assert 0.8 < _saved_bytes(pol.model, ids) / est < 1.25


def test_the_cpu_budget_is_capped_and_a_big_micro_batch_then_recomputes(monkeypatch):
    monkeypatch.setattr(levers, "available_ram", lambda: 20 * 2**30)
    assert levers.free_memory("cpu") == levers.CPU_BUDGET
    monkeypatch.setattr(levers, "available_ram", lambda: 2**30)
    assert levers.free_memory("cpu") == 2**30  # less available than the cap: what there is
    # SmolLM2-135M's shape in fp32, as the default run: its old micro-batch of 64 would plan ~15 GiB
    shape = levers.Shape(hidden=576, intermediate=1536, kv=192, layers=30, vocab=49152, act_bytes=4)
    old = levers.choose(shape, 64 * 176, levers.CPU_BUDGET, gradient_checkpointing=None, logprob_chunk_size=None)
    assert old.gradient_checkpointing and old.fits()
    assert 3 * old.logprob_chunk_size * shape.vocab * 4 <= 0.2 * 2**30
    # its micro-batch of 16 keeps its activations (no recompute), in fp32 and bf16 alike
    for act in (4, 2):
        shape.act_bytes = act
        new = levers.choose(shape, 16 * 176, levers.CPU_BUDGET, gradient_checkpointing=None, logprob_chunk_size=None)
        assert not new.gradient_checkpointing and new.fits()


@pytest.mark.parametrize("kv_dtype,dtype", [("auto", torch.float32), ("auto", torch.bfloat16), ("fp8", torch.bfloat16)])
def test_a_decode_tokens_kv_lands_where_advanced_indexing_puts_it(kv_dtype, dtype):
    from types import SimpleNamespace

    from qerl.rollout.kv_cache import KVCache, _quantize

    view = SimpleNamespace(n_layers=2, n_kv=3, head_dim=8, device=torch.device("cpu"), dtype=dtype)
    cache = KVCache(view, n_slots=6, max_len=10, kv_dtype=kv_dtype)
    torch.manual_seed(0)
    want = [t.clone() for t in cache.k + cache.v]  # layers 0, 1 of K, then of V
    for n, pos in ((6, [3, 0, 9, 5, 5, 1]), (4, [4, 1, 0, 6])):  # all slots, then the first 4 (the batch shrinks)
        pos = torch.tensor(pos)
        # [n, Hkv, d] read out of a [n, 1, Hkv, d] projection, as the decode step hands them over (not contiguous)
        k, v = (torch.randn(n, 1, 3, 8, dtype=dtype).transpose(1, 2)[:, :, 0] for _ in range(2))
        cache.write_token(1, n, pos, k, v)
        for ref, x, sc in ((want[1], k, cache.k_scale[1]), (want[3], v, cache.v_scale[1])):
            ref[torch.arange(n), :, pos] = _quantize(x, sc[:n]) if cache.fp8 else x
    bits = (lambda t: t.view(torch.uint8)) if cache.fp8 else (lambda t: t)
    for got, ref in zip(cache.k + cache.v, want):
        assert torch.equal(bits(got), bits(ref))


def test_a_batch_shape_on_the_command_line_starts_from_the_trainers_defaults():
    # the default run's 4 x 16 split of its 64 completions is not imposed on `qerl train --per_device_train_batch_size
    # 4 --generation_batch_size 4` (which would not split into updates of 4 x 4)
    from qerl.cli.train import apply, batch_shape_reset

    ov = {"per_device_train_batch_size": "4", "generation_batch_size": "4", "num_generations": "2"}
    cfg = apply(batch_shape_reset(default_run_config("cpu"), ov), ov)
    plan = batch_plan(cfg)
    assert (plan.generation_batch_size, plan.steps_per_generation, plan.updates_per_rank) == (4, 1, 1)
    # untouched, the default run keeps its own split
    assert batch_shape_reset(default_run_config("cpu"), {"learning_rate": "1e-3"}).gradient_accumulation_steps == 4


def test_the_folded_rollout_copies_are_gone_before_the_update(tmp_path, monkeypatch):
    # the CPU run keeps one weight cache for the whole run; the rollout's adapter-folded copies (a second
    # dequantized model) are freed before the update, which is where the default run peaks
    from qerl.kernels import dispatch

    tr = _trainer(tmp_path)
    seen = {}
    drop = dispatch.drop_folded
    monkeypatch.setattr(dispatch, "drop_folded", lambda: seen.setdefault("freed", drop()))
    step = tr.optimizer.step

    def record(*a, **k):
        seen.setdefault("folded_at_step", any(k[0] == "merged" for k in dispatch._CACHE))
        return step(*a, **k)

    tr.optimizer.step = record
    with dispatch.dequantized_cache():
        tr.train_step()
        assert any(k[0] != "merged" for k in dispatch._CACHE)  # the update's plain copies stay cached
    assert seen["freed"] > 0 and seen["folded_at_step"] is False
