"""The CPU rollout's weight cache (kernels/dispatch.dequantized_cache): adapters folded into the
dequantized copies, weights packed for oneDNN, and a batch that shrinks after every step.

References: the same layers outside the cache (dequantize + separate LoRA shrink/expand), a float64
W + scaling·B·A computed here, and nn.Linear itself.
"""

import pytest
import torch
from test_fused_groups import groups_of, policy, randomize_lora
from tiny_models import save_tiny

from qerl.kernels import dispatch, settings
from qerl.model import quantized_layers
from qerl.rollout import Engine, SamplingParams


@pytest.fixture
def base(tmp_path):
    save_tiny(tmp_path / "base", "qwen2")  # q/k/v carry biases
    return tmp_path / "base"


def _float64_reference(layer, x):
    w = layer.dequantized_weight(torch.float64) + layer.scaling * (
        layer.lora_B.weight.double() @ layer.lora_A.weight.double())
    y = x.double() @ w.T
    return y if layer.bias is None else y + layer.bias.double()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_folded_adapter_matches_the_separate_lora_path(base, dtype, tol):
    pol = policy(base, rank=8, dtype=dtype)
    randomize_lora(pol.model)
    x = torch.randn(3, 4, pol.config.hidden_size, dtype=dtype)
    with torch.no_grad():
        for g in groups_of(pol.model).values():
            plain = g(x)  # outside the cache: base GEMM + shrink + expands
            with dispatch.dequantized_cache():
                folded = g(x)
                assert any(k[0] == "merged" for k in dispatch._CACHE)
            for m, a, b in zip(g.members, plain, folded):
                ref = _float64_reference(m, x)
                scale = ref.abs().max()
                assert (b.double() - ref).abs().max() <= tol * scale
                assert (a.double() - ref).abs().max() <= tol * scale
        singles = [layer for _, layer in quantized_layers(pol.model) if layer.group is None]  # o, down
        assert singles
        for layer in singles:
            xs = torch.randn(3, 4, layer.in_features, dtype=dtype)
            with dispatch.dequantized_cache(), torch.no_grad():
                y = layer(xs)
                assert any(k[0] == "merged" for k in dispatch._CACHE)  # the folded path ran
            ref = _float64_reference(layer, xs)
            assert y.dtype == dtype and (y.double() - ref).abs().max() <= tol * ref.abs().max()


def test_an_optimizer_step_between_rollouts_replaces_the_folded_copy(base):
    pol = policy(base, rank=4)
    randomize_lora(pol.model)
    layer = next(layer for _, layer in quantized_layers(pol.model) if layer.group is None)
    x = torch.randn(2, layer.in_features)
    with dispatch.dequantized_cache(), torch.no_grad():
        y0 = layer(x)
        n0 = len(dispatch._CACHE)
        layer.lora_B.weight.add_(0.05)  # what an optimizer step does: in place, the version moves
        y1 = layer(x)
        assert len(dispatch._CACHE) == n0  # the entry was replaced, not added to
    assert not torch.allclose(y0, y1)
    torch.testing.assert_close(y1.double(), _float64_reference(layer, x), rtol=1e-5, atol=1e-5)


def test_drop_folded_frees_the_folded_copies_and_keeps_the_rest(base):
    pol = policy(base, rank=4)
    randomize_lora(pol.model)
    layer = next(layer for _, layer in quantized_layers(pol.model) if layer.group is None)
    x = torch.randn(2, layer.in_features)
    with dispatch.dequantized_cache(), torch.no_grad():
        y0 = layer(x)  # folded (rollout path)
        with torch.enable_grad():
            layer(x.requires_grad_())  # the training path: a plain dequantized copy
        x = x.detach()
        merged = [v[4] for k, v in dispatch._CACHE.items() if k[0] == "merged"]
        plain = [k for k in dispatch._CACHE if k[0] != "merged"]
        assert merged and plain
        want = sum(m.w.nbytes if isinstance(m, dispatch._Packed) else m.nbytes for m in merged)
        assert dispatch.drop_folded() == want > 0
        assert not any(k[0] == "merged" for k in dispatch._CACHE)
        assert [k for k in dispatch._CACHE] == plain  # the update's copies stay
        assert dispatch.drop_folded() == 0
        torch.testing.assert_close(layer(x), y0)  # rebuilt on the next rollout call, the same
    assert dispatch.drop_folded() == 0  # outside a cache: nothing to do


def test_cpu_decode_attends_over_the_keys_there_are(base):
    pol = policy(base, rank=4)
    sp = SamplingParams(max_new_tokens=20, greedy=True, ignore_eos=True)
    eng = Engine(pol.model, max_len=200, max_slots=4)
    out = eng.generate([[5, 6, 7]] * 2, n=1, params=sp)
    keys = {k for _, k, _ in out.stats.chunks}
    # 3 prompt tokens + 20 new: every step's keys fit in 24, each a multiple of 8 (a GPU graph's bucket: 128)
    assert keys and all(k % 8 == 0 and k <= 32 for k in keys) and max(keys) >= 23


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_linear_in_the_cache_is_the_module(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 300, bias=False).to(dtype).requires_grad_(False)
    x = torch.randn(5, 64, dtype=dtype)
    with dispatch.dequantized_cache():
        y = dispatch.frozen_linear(lin, x)
        packed = any(isinstance(v[-1], dispatch._Packed) for v in dispatch._CACHE.values())
    ref = lin(x)
    if dtype == torch.bfloat16:  # same bf16 GEMM, only the weight's layout differs
        assert torch.equal(y, ref) or not packed
    else:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    lin.weight.requires_grad_(True)  # a trainable weight is never cached
    with dispatch.dequantized_cache():
        dispatch.frozen_linear(lin, x)
        assert not dispatch._CACHE


def test_cpu_engine_batch_shrinks_as_samples_finish(base):
    pol = policy(base, rank=4)
    randomize_lora(pol.model)
    limits = {0: 3, 1: 20, 2: 7, 3: 12}  # each sample stops at its own limit
    sp = SamplingParams(max_new_tokens=20, greedy=True, ignore_eos=True,
                        sample_max_new_tokens=lambda key, j: limits[key])
    eng = Engine(pol.model, max_len=64, max_slots=8)
    assert eng.sync_every == 1  # the CPU retires after every step
    out = eng.generate([[5, 6, 7]] * 4, n=1, params=sp)
    assert [len(c.token_ids) for c in out] == [3, 20, 7, 12]
    batches = [b for b, _, _ in out.stats.chunks]
    assert batches[0] == 4 and batches[-1] == 1 and batches == sorted(batches, reverse=True)
    # decode steps run only live samples: the token steps equal the tokens produced after the first
    assert sum(batches) == sum(limits.values()) - 4
    # the same completions as a GPU-style engine that syncs every 16 steps over bucketed batches
    ref = Engine(pol.model, max_len=64, max_slots=8, sync_every=16).generate([[5, 6, 7]] * 4, n=1, params=sp)
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]


def test_cpu_rollout_bench_runs_both_paths_and_restores_the_switch(base, monkeypatch):
    """run() on a tiny model (the scripted-clock test below checks its arithmetic): both paths generate, each
    round is logged, and the fold switch is back to its value after."""
    from types import SimpleNamespace

    from qerl.bench import cpu_rollout

    pol = policy(base, rank=4)
    randomize_lora(pol.model)
    cfg = SimpleNamespace(max_completion_length=6, temperature=1.0, max_prompt_length=8, num_generations=2)
    monkeypatch.setattr(cpu_rollout, "_setup", lambda: (cfg, pol, [[5, 6, 7], [8, 9]]))
    lines = []
    with settings.use(fold_and_pack=False):  # run()'s last case sets True: a leak would show here
        res = cpu_rollout.run(repeats=1, log=lines.append)
        assert settings.current().fold_and_pack is False
    for k in ("plain", "folded"):
        assert res[k]["median_s"] > 0 and 0 < res[k]["new_tokens"] <= 2 * 2 * 6
    assert any("plain" in x for x in lines) and any("folded" in x for x in lines)


@pytest.mark.slow
def test_cpu_rollout_bench_setup_is_the_default_runs():
    """_setup builds the default run's policy (its config, adapters moved off zero) and 4 of its prompts."""
    from qerl.bench import cpu_rollout
    from qerl.rl.default_run import default_run_config

    cfg, pol, prompts = cpu_rollout._setup()
    want = default_run_config("cpu")
    assert (cfg.model_name_or_path, cfg.quant, cfg.lora_r) == (want.model_name_or_path, want.quant, want.lora_r)
    assert len(prompts) == 4 and all(0 < len(x) <= cfg.max_prompt_length for x in prompts)
    bs = [p for n, p in pol.model.named_parameters() if n.endswith("lora_B.weight")]
    assert bs and all(b.abs().sum() > 0 for b in bs)


def test_cpu_rollout_bench_arithmetic_on_a_scripted_clock(base, monkeypatch):
    """The bench's figures on a tiny model and a clock that returns chosen round times: round 0 warms up
    (50 s each, not counted); then plain takes 4, 1, 2 s and folded 0.5, 3, 1 s. By hand: the medians are
    2 s and 1 s (the means, 2.33 and 1.5, would differ), the best 1 s and 0.5 s; tokens/s is a case's new
    tokens over its median, so folded's speedup is (n_folded / 1) / (n_plain / 2) = 2 n_folded / n_plain."""
    from types import SimpleNamespace

    from qerl.bench import cpu_rollout

    pol = policy(base, rank=4)
    randomize_lora(pol.model)
    cfg = SimpleNamespace(max_completion_length=6, temperature=1.0, max_prompt_length=8, num_generations=2)
    monkeypatch.setattr(cpu_rollout, "_setup", lambda: (cfg, pol, [[5, 6, 7], [8, 9]]))
    durations = iter([50, 50, 4.0, 0.5, 1.0, 3.0, 2.0, 1.0])  # (round, case) in run order: plain, folded
    clock = {"now": 0.0, "started": False}

    def perf_counter():  # each case's start, then its end `duration` later
        if clock["started"]:
            clock["now"] += next(durations)
        clock["started"] = not clock["started"]
        return clock["now"]

    monkeypatch.setattr(cpu_rollout, "time", SimpleNamespace(perf_counter=perf_counter))
    res = cpu_rollout.run(repeats=3, log=lambda _: None)
    assert next(durations, None) is None  # every round of both cases was timed
    assert res["plain"]["median_s"] == 2.0 and res["plain"]["best_s"] == 1.0
    assert res["folded"]["median_s"] == 1.0 and res["folded"]["best_s"] == 0.5
    n_plain, n_folded = res["plain"]["new_tokens"], res["folded"]["new_tokens"]
    assert 0 < n_plain <= 2 * 2 * 6 and 0 < n_folded <= 2 * 2 * 6  # 2 prompts x 2 samples x up to 6 tokens
    assert res["plain"]["tokens_per_s"] == n_plain / 2.0 and res["folded"]["tokens_per_s"] == n_folded / 1.0
    assert res["speedup"] == pytest.approx(2 * n_folded / n_plain)
