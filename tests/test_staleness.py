"""Issue 32 §2, bounded staleness on the CPU: max_staleness 0 is the synchronous step; 1 is bit for bit
the sequential run that samples step k+1 with adapter k before updating step k; a run killed in any
phase with a rollout in flight resumes to the same adapter; the engine samples from its snapshot while
the live adapter changes under it."""

import threading

import pytest
import torch

from qerl.rl.advantages import rollout_batch
from qerl.train.logprobs import completion_logprobs, pad_batch
from qerl.rl.staleness import ROLLOUT_ADAPTER
from qerl.rollout import SamplingParams
from test_trainer import _trainable, _trainer

# AQN noisy from step 2 (in the rollouts and, aqn_in_training, in the update), two PPO passes with
# LoRA dropout (the update draws from the global generator), DAPO resampling rounds
OPTS = dict(max_steps=4, aqn_stages=2, aqn_in_training=True, num_iterations=2, lora_dropout=0.1,
            importance_sampling_correction=True)


def _rollout_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("qerl-rollout") and t.is_alive()]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _sequential(tr, n_steps: int, lag: int) -> list:
    """The step as plain phase calls: rollout of step k from adapter k - lag, then the update of step k."""
    cfg, rewards = tr.cfg, []
    ready = {0: tr.collect_rollouts(tr.step_context(0, 0))}
    for k in range(n_steps):
        ro = ready.pop(k)
        batch = rollout_batch(ro.groups, cfg.num_generations, cfg.scale_rewards, tr.dist)
        rewards.append([r.rewards.clone() for r in ro.rounds])
        if lag and k + 1 < n_steps:  # sampled with adapter k, before the update makes k+1
            ready[k + 1] = tr.collect_rollouts(tr.step_context(k + 1, k))
        tr.update(batch, ro.ctx.sigma, ro.ctx.seed)
        if not lag and k + 1 < n_steps:
            ready[k + 1] = tr.collect_rollouts(tr.step_context(k + 1, k + 1))
    return rewards


def test_staleness_0_is_the_synchronous_step(tmp_path):
    a = _trainer(tmp_path / "a", **OPTS)
    assert a.snapshot is None and a.engine.model is a.model  # no copy: the engine reads the live adapter
    rows = a.train()
    assert [r["staleness"] for r in rows] == [0, 0, 0, 0]
    b = _trainer(tmp_path / "b", **OPTS)
    _sequential(b, 4, lag=0)
    assert _same(_trainable(a), _trainable(b))


# the second: trained norms (in the adapter copy too) and a KL term (the update's reference pass turns the
# live adapters off while the rollout beside it samples with its own)
@pytest.mark.parametrize("more", [{}, {"train_norms": True, "beta": 0.05, "loss_type": "grpo"}])
def test_staleness_1_equals_sampling_with_the_previous_adapter_then_updating(tmp_path, more):
    opts = {**OPTS, **more}
    a = _trainer(tmp_path / "a", max_staleness=1, **opts)
    assert a.engine.model is a.snapshot.model and a.snapshot.nbytes() > 0
    start = _trainable(a)
    rows = a.train()
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]
    assert all(r["policy_ratio_min"] <= r["policy_ratio_mean"] <= r["policy_ratio_max"] for r in rows)
    assert all(r["time_rollout"] > 0 and "time_rollout_wait" in r for r in rows)
    # the parity gate (step 0) probed the engine's own adapter copy: the probe reached it
    assert rows[0]["parity_adapter_effect_engine"] > 0.1 and rows[0]["parity_adapter_diff_mean"] < 0.1
    b = _trainer(tmp_path / "b", **opts)
    rewards = _sequential(b, 4, lag=1)
    wa, wb = _trainable(a), _trainable(b)
    assert _same(wa, wb)
    assert not _same(wa, start)
    assert [r["reward_mean"] for r in rows] == pytest.approx([float(torch.cat([x.flatten() for x in rs]).mean())
                                                              for rs in rewards], rel=0, abs=0)
    # and the lag is real: the synchronous run ends elsewhere
    c = _trainer(tmp_path / "c", **opts)
    c.train()
    assert not _same(_trainable(c), wa)


@pytest.mark.parametrize("where", ["rollout_wait", "rewards", "advantages", "metrics", "logprob", "update",
                                   "checkpoint"])
def test_kill_and_resume_in_any_phase_with_a_rollout_in_flight(tmp_path, where):
    kw = dict(OPTS, max_staleness=1, save_steps=1, save_total_limit=None)
    ref = _trainer(tmp_path / "ref", **kw)
    ref.train()
    armed = [True]

    def kill(name, event):
        if name == where and event == "start" and tr.step == 2 and armed[0]:
            armed[0] = False
            raise KeyboardInterrupt(f"killed in {name}")

    tr = _trainer(tmp_path / "run", **kw)
    if where == "rewards":  # on the worker thread: step 2's rollout, launched during step 1's update
        first = tr.reward_funcs[0]

        def reward(completions, **kx):
            if tr.step == 1 and armed[0] and threading.current_thread() is not threading.main_thread():
                armed[0] = False
                raise KeyboardInterrupt("killed in rewards")
            return first(completions, **kx)

        tr.reward_funcs[0] = reward
    tr.profiler.listeners.append(kill)
    with pytest.raises(KeyboardInterrupt) as e:
        tr.train()
    assert not _rollout_threads()  # the killed trainer's rollout did not outlive it
    assert where in str(e.value) and not armed[0]
    last = sorted((tmp_path / "run").glob("checkpoint-*"))[-1]
    assert (last / f"{ROLLOUT_ADAPTER}.safetensors").exists()  # written with the next rollout in flight
    res = _trainer(tmp_path / "run", **kw)
    step = res.resume()
    assert step == int(last.name.split("-")[1])
    rows = res.train()
    assert rows[0]["staleness"] == 1  # the rollout relaunched from its own adapter, one version back
    assert _same(_trainable(ref), _trainable(res))


def test_the_engine_samples_from_its_snapshot_while_the_adapter_changes(tmp_path):
    tr = _trainer(tmp_path, max_staleness=1, max_completion_length=24)
    lora = [p for n, p in tr.model.named_parameters() if "lora_" in n]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in lora:
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    tr.snapshot.refresh(0)
    version_k = [p.detach().clone() for p in lora]
    prompts = [tr.encode_prompt(r) for r in tr.train_rows[:4]]
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5)
    out, writes = {}, [0]
    worker = threading.Thread(target=lambda: out.setdefault("c", tr.engine.generate(prompts, n=2, params=params)))
    worker.start()
    with torch.no_grad():  # optimizer-like in-place steps on the live adapter all through the rollout
        while worker.is_alive() or writes[0] < 3:
            for p in lora:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
            writes[0] += 1
    worker.join()
    comps = out["c"]
    assert writes[0] >= 3

    def trainer_logprobs():
        ids, att, pos, tg, mask = pad_batch([c.prompt_ids for c in comps], [c.token_ids for c in comps], pad_id=0)
        with torch.no_grad():
            lp, _ = completion_logprobs(tr.model, ids, att, pos, tg, mask, temperature=1.0)
        return [lp[i, :len(c.token_ids)] for i, c in enumerate(comps)]

    moved = trainer_logprobs()  # the adapter as it ended: far from the one sampled with
    with torch.no_grad():
        for p, v in zip(lora, version_k):
            p.copy_(v)
    want = trainer_logprobs()  # the independent path (HF forward) with adapter version k
    for c, w, m in zip(comps, want, moved):
        got = torch.tensor(c.logprobs)
        assert torch.allclose(got, w, atol=2e-4), (got - w).abs().max()
        assert (got - m).abs().max() > 1e-2
    # and the same tokens and logprobs, bit for bit, as with nothing changing under the rollout
    again = tr.engine.generate(prompts, n=2, params=params)
    assert [c.token_ids for c in again] == [c.token_ids for c in comps]
    assert [c.logprobs for c in again] == [c.logprobs for c in comps]


def test_bench_step_runs_with_a_rollout_in_flight(tmp_path):
    from test_bench_step import _args

    from qerl.bench import step as bstep

    a = _args(["--out", str(tmp_path), "--steps", "3", "--max-new-tokens", "40"])
    a.max_staleness = 1
    res = bstep.run_case(a, None, None)
    assert res["fits"] and "stale1" in res["case"]
    assert not _rollout_threads()  # the last step's in-flight rollout was waited for
    assert [s["staleness"] for s in res["steps"]] == [1, 1, 1]
    # from the per-step records: the 8 rows (2 prompts x 4 samples) over the mean time of the steady steps (the first timed step,
    # which compiles the update, is reported apart and left out)
    steady = [s["step_s"] for s in res["steps"][1:]]
    assert res["completions_per_s"] == pytest.approx(8 / (sum(steady) / len(steady)))
    # the first timed step's rollout was launched during the warm-up: short; the others at their limits
    assert res["steps"][0]["completion_length_mean"] <= bstep.WARMUP_NEW_TOKENS
    assert res["steps"][-1]["completion_length_mean"] > bstep.WARMUP_NEW_TOKENS


def test_rollout_noise_stays_on_the_snapshot(tmp_path):
    """AQN: a rollout's noise lives on the engine's norms (the snapshot's); the live model's forward,
    which the concurrent update runs, is the noiseless one bit for bit while it is applied."""
    tr = _trainer(tmp_path, max_staleness=1)
    assert tr.rollout_aqn is not tr.aqn and set(tr.rollout_aqn.noise) == set(tr.aqn.noise)
    ids = torch.tensor([tr.encode_prompt(tr.train_rows[0])])
    with torch.no_grad():
        clean = tr.model(ids).logits
        with tr.rollout_aqn.applied(0.05, 7):
            during = tr.model(ids).logits
            noisy_engine = tr.snapshot.model(ids).logits
    assert torch.equal(clean, during)
    assert not torch.allclose(noisy_engine, clean, atol=1e-4)
    assert all(float(b.abs().max()) == 0 for b in tr.aqn.noise.values())


def test_the_memory_planner_sets_aside_the_rollout_beside_the_update(tmp_path, monkeypatch):
    """max_staleness 1: the adapter copy exists before the levers measure free memory, and the decode
    buffers of the rollout that runs beside the update are taken off what the update may use."""
    from qerl.train import levers

    seen = []
    real = levers.choose
    monkeypatch.setattr(levers, "free_memory", lambda device: 10**9)
    monkeypatch.setattr(levers, "choose", lambda shape, tokens, free, **kw: seen.append(free) or
                        real(shape, tokens, free, **kw))
    sync = _trainer(tmp_path / "a")
    stale = _trainer(tmp_path / "b", max_staleness=1)
    assert sync.rollout_reserve_bytes() == 0 and seen[0] == 10**9
    vocab = stale.model.config.vocab_size
    assert stale.rollout_reserve_bytes() == 3 * stale.engine.n_slots * vocab * 4
    assert seen[1] == 10**9 - stale.rollout_reserve_bytes()
    # one adapter's worth: every trainable tensor once, nothing of the frozen base
    assert stale.snapshot.nbytes() == sum(p.numel() * p.element_size() for p in stale.params)
    frozen = {t.data_ptr() for t in stale.model.buffers()}
    assert frozen and frozen == {t.data_ptr() for t in stale.snapshot.model.buffers()}


def test_max_staleness_beyond_1_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="max_staleness"):
        _trainer(tmp_path, max_staleness=2)


def test_each_rollout_returns_its_own_stats(tmp_path):
    tr = _trainer(tmp_path)
    prompts = [tr.encode_prompt(r) for r in tr.train_rows[:2]]
    a = tr.engine.generate(prompts, n=2, params=SamplingParams(max_new_tokens=3, seed=1))
    b = tr.engine.generate(prompts, n=1, params=SamplingParams(max_new_tokens=5, seed=1))
    assert a.stats is not b.stats
    assert a.stats.new_tokens == sum(len(c.token_ids) for c in a)
    assert b.stats.new_tokens == sum(len(c.token_ids) for c in b)
    assert not any(k.startswith("_turns") or k.startswith("_limits") for k in vars(tr.engine))


def test_evaluation_and_parity_checks_between_steps_leave_the_staleness_1_run_unchanged(tmp_path):
    """Both use the engine, so they wait for the rollout in flight and point the engine's adapter copy
    at the live adapter; the rollout already drawn keeps the adapter it was sampled with."""
    kw = dict(OPTS, max_staleness=1)
    a = _trainer(tmp_path / "a", eval_steps=1, eval_limit=4, eval_max_completion_length=6, parity_check_steps=1, **kw)
    rows = a.train()
    assert len(a.evals) == 4 and all("parity_adapter_diff_mean" in r for r in rows)
    b = _trainer(tmp_path / "b", parity_check_steps=0, **kw)
    b.train()
    assert _same(_trainable(a), _trainable(b))


def test_a_resumed_run_saved_before_its_first_step_keeps_the_rollout_in_flight(tmp_path):
    import json

    from safetensors.torch import load_file

    kw = dict(OPTS, max_staleness=1, save_steps=1, save_total_limit=None)
    a = _trainer(tmp_path / "run", **kw)
    a.train(stop_after=2)
    ck = tmp_path / "run" / "checkpoint-2"
    before = load_file(str(ck / f"{ROLLOUT_ADAPTER}.safetensors"))
    state = json.loads((ck / "trainer_state.json").read_text())
    b = _trainer(tmp_path / "run", **kw)
    b.resume()
    b.save()  # the same step again: the folder is replaced whole
    try:
        again = load_file(str(ck / f"{ROLLOUT_ADAPTER}.safetensors"))
        st2 = json.loads((ck / "trainer_state.json").read_text())
    finally:
        b._release()
    assert _same(before, again) and not _same(before, _trainable(b))  # adapter k-1, not the live k
    assert st2["in_flight"] == state["in_flight"] and st2["data"] == state["data"]


def test_the_worker_keeps_the_launching_threads_kernel_settings(tmp_path):
    """The rollout thread runs under the kernel settings in force where it was launched, not the
    defaults, and not what the update's thread enters meanwhile."""
    from qerl.kernels import settings
    from qerl.rl.staleness import InFlight

    seen = []
    gate = threading.Event()

    def run():
        gate.wait(5)
        seen.append(settings.current())
        return None

    ctx = _trainer(tmp_path).step_context(0, 0)
    with settings.use(fold_and_pack=False):
        fl = InFlight(ctx, {}, run, threaded=True, device=torch.device("cpu"))
    with settings.use(fuse_lora=False):  # the update's old-policy pass, on this thread
        gate.set()
        fl.result()
    assert seen[0].fold_and_pack is False and seen[0].fuse_lora is True
