"""The GRPO/DAPO trainer on the CPU: losses against hand-written references, chunked logprobs
against a full forward, exact resume, atomic checkpoints, failure handling, config."""

import json

import pytest
import torch

from qerl.model import random_policy
from qerl.rl import GRPOConfig, GRPOTrainer, TrainingError
from qerl.train import checkpoints as ckpt
from qerl.rl.advantages import group_advantages, informative_groups, overlong_penalty
from qerl.train.logprobs import completion_logprobs, pad_batch
from qerl.rl.loss import policy_loss
from qerl.tasks import get_task
from tiny_models import config, tiny_tokenizer


def sevens(completions, **_):
    return [c.count("7") / max(1, len(c)) for c in completions]


def _trainer(out, reward_funcs=(sevens,), **kw):
    torch.manual_seed(0)
    pol = random_policy(config("qwen2"), "nvfp4", lora_rank=8, device="cpu", dtype=torch.float32, std=0.05,
                        progress=False)
    pol.tokenizer = tiny_tokenizer()
    base = dict(max_steps=4, generation_batch_size=16, num_generations=4, per_device_train_batch_size=4,
                gradient_accumulation_steps=2, max_completion_length=12, max_prompt_length=64, learning_rate=1e-2,
                aqn_stages=2, output_dir=str(out), save_steps=2, report_to="none",
                device="cpu")  # the policy is built on the CPU: keep the trainer there on GPU machines too
    merged = {**base, **kw}
    merged["aqn_stages"] = min(merged["aqn_stages"], merged["max_steps"])
    cfg = GRPOConfig(**merged)
    return GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=40), reward_funcs=list(reward_funcs),
                       progress=False)


def _trainable(tr):
    return {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}


# ---- loss and advantages against independent per-token loops --------------------------------
def _ref_loss(logp, old, adv, mask, loss_type, eps, eps_hi, max_len):
    per_seq, tot, ntok = [], 0.0, 0
    for i in range(logp.shape[0]):
        terms = []
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            r = float(torch.exp(logp[i, t] - old[i, t]))
            a = float(adv[i])
            terms.append(-min(r * a, min(max(r, 1 - eps), 1 + eps_hi) * a))
        per_seq.append(sum(terms) / max(1, len(terms)))
        tot += sum(terms)
        ntok += len(terms)
    return {"grpo": sum(per_seq) / len(per_seq), "bnpo": tot / ntok, "dapo": tot / ntok,
            "dr_grpo": tot / (logp.shape[0] * max_len)}[loss_type]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_policy_loss_matches_a_per_token_reference(loss_type):
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(5, 7, generator=g) * 3
    old = logp + torch.randn(5, 7, generator=g) * 0.3  # ratios well outside [0.8, 1.28]
    adv = torch.randn(5, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[:, 0] = True
    loss, st = policy_loss(logp, old, adv, mask, loss_type=loss_type, epsilon=0.2, epsilon_high=0.28,
                           max_completion_length=10)
    assert float(loss) == pytest.approx(_ref_loss(logp, old, adv, mask, loss_type, 0.2, 0.28, 10), rel=1e-5)
    assert 0 < st["clip_fraction"] < 1


def test_kl_term_is_zero_at_the_reference():
    logp = -torch.rand(3, 4)
    mask = torch.ones(3, 4, dtype=torch.bool)
    adv = torch.zeros(3)
    l0, st0 = policy_loss(logp, logp, adv, mask, loss_type="bnpo", epsilon=0.2, epsilon_high=None, beta=0.1,
                          ref_logp=logp)
    assert float(l0) == 0 and st0["kl"] == 0


def test_kl_term_averages_to_the_exact_kl_over_the_policys_own_samples():
    """The per-token k3 estimate, averaged over tokens drawn from the policy pi, is KL(pi || ref). A
    batch holding each of 4 tokens exactly as often as pi draws it (1/2, 1/4, 1/8, 1/8 of 8 tokens)
    makes that average exact, so the reported KL must equal the brute-force sum over the vocabulary."""
    pi = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    ref = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    tokens = torch.tensor([0, 0, 0, 0, 1, 1, 2, 3])
    logp, ref_logp = pi.log()[tokens].view(2, 4), ref.log()[tokens].view(2, 4)
    mask = torch.ones(2, 4, dtype=torch.bool)
    loss, st = policy_loss(logp, logp, torch.zeros(2), mask, loss_type="bnpo", epsilon=0.2, epsilon_high=None,
                           beta=0.1, ref_logp=ref_logp)
    exact = sum(float(p * (p / q).log()) for p, q in zip(pi, ref))  # brute force over the 4 tokens; by hand:
    # 0.5 ln 5 + 0.25 ln 1.25 + 0.125 ln(0.125/0.3) + 0.125 ln(0.125/0.4) = 0.80472 + 0.05579 - 0.10943 - 0.14540
    assert exact == pytest.approx(0.60568, abs=1e-5)
    assert st["kl"] == pytest.approx(exact, rel=1e-9)
    assert float(loss) == pytest.approx(0.1 * exact, rel=1e-9)  # advantages 0: the loss is beta x KL alone
    near = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)  # a reference nearer pi: KL 0.03513
    _, st2 = policy_loss(logp, logp, torch.zeros(2), mask, loss_type="bnpo", epsilon=0.2, epsilon_high=None,
                         beta=0.1, ref_logp=near.log()[tokens].view(2, 4))
    assert st2["kl"] == pytest.approx(sum(float(p * (p / q).log()) for p, q in zip(pi, near)), rel=1e-9)
    assert st2["kl"] == pytest.approx(0.035134, abs=1e-6)
    # k1 (log pi - log ref) has the same mean on pi's own samples; k3 (TRL's) differs in that each token's term
    # r - ln r - 1, r = ref / pi, is >= 0. On the two tokens ref favours alone (r = 2.4 and 3.2), k1 averages
    # (-ln 2.4 - ln 3.2) / 2 = -1.0193 while k3 averages ((1.4 - 0.875469) + (2.2 - 1.163151)) / 2 = 0.780690
    _, st3 = policy_loss(logp[1:, 2:], logp[1:, 2:], torch.zeros(1), mask[1:, 2:], loss_type="bnpo", epsilon=0.2,
                         epsilon_high=None, beta=0.1, ref_logp=ref_logp[1:, 2:])
    assert st3["kl"] == pytest.approx(0.780690, abs=1e-6)


def test_advantages_and_penalties():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # by hand: group 0 has mean 1/2 and (unbiased) std sqrt(1/3); the whole batch's std is sqrt(5.5 / 7)
    a = group_advantages(r, "group")
    assert a[0].tolist() == pytest.approx([0.865875, -0.865875, -0.865875, 0.865875], abs=1e-5)  # 0.5 / (0.57735 + 1e-4)
    assert torch.equal(a[1], torch.zeros(4))  # a group whose rewards are all equal teaches nothing
    assert group_advantages(r, "none")[0].tolist() == [0.5, -0.5, -0.5, 0.5]
    b = group_advantages(r, "batch")  # 0.5 / (0.886405 + 1e-4)
    assert b[0].tolist() == pytest.approx([0.564012, -0.564012, -0.564012, 0.564012], abs=1e-5)
    assert torch.equal(b[1], torch.zeros(4))
    assert informative_groups(r).tolist() == [True, False]
    pen = overlong_penalty(torch.tensor([10, 16, 18, 20, 25]), max_len=20, buffer=4, factor=1.0)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])


def test_group_advantages_are_centred_ordered_and_invariant_to_shift_and_scale():
    g = torch.Generator().manual_seed(3)
    r = torch.rand(6, 8, generator=g, dtype=torch.float64)
    for scale in ("group", "batch", "none"):
        a = group_advantages(r, scale)
        assert a.sum(1).abs().max() < 1e-12  # each group's advantages sum to 0
        # within a group, a higher reward never gets a lower advantage
        order = r.argsort(1)
        assert (a.gather(1, order).diff(dim=1) > 0).all()
        # a constant added to every reward of a group (a reward's offset) changes nothing
        shift = torch.arange(6, dtype=torch.float64)[:, None] * 10
        if scale != "batch":  # the batch's std sees the offsets between groups
            torch.testing.assert_close(group_advantages(r + shift, scale), a, atol=1e-12, rtol=0)
    # group scaling: a reward in other units (x 1000) gives the same advantages (up to the 1e-4 guard)
    torch.testing.assert_close(group_advantages(r * 1000, "group"), group_advantages(r, "group"), atol=2e-3, rtol=0)
    # the group's std is the unbiased one: the rewards 0 and 2 give std sqrt(2), advantages -+1 / (sqrt 2 + 1e-4)
    assert group_advantages(torch.tensor([[0.0, 2.0]]), "group")[0].tolist() == pytest.approx([-0.70706, 0.70706],
                                                                                               abs=1e-5)


def test_batch_scaling_divides_by_the_std_of_every_ranks_chosen_rewards():
    """rollout_batch with scale_rewards='batch' (TRL's: centred in the group, divided by the std of all the step's
    rewards, here over two ranks). This rank chose group 0 of round A (rewards 1, 0) and group 0 of round B (2, 4);
    the other rank's chosen rewards are 5, 5. By hand: the six rewards 1 0 2 4 5 5 have mean 17/6 and unbiased
    variance 22.8333 / 5 = 4.56667, std 2.136976; the advantages are -+0.5 and -+1 over (2.136976 + 1e-4):
    0.5 / 2.137076 = 0.233965 and 1 / 2.137076 = 0.467929. Round A's group 1 (3, 3) was not chosen: not counted."""
    from types import SimpleNamespace

    from qerl.rl.advantages import rollout_batch

    def comps(n, reason="stop"):
        return [SimpleNamespace(finish_reason=reason, k=i) for i in range(n)]

    a = SimpleNamespace(rewards=torch.tensor([[1.0, 0.0], [3.0, 3.0]]), completions=comps(4))
    b = SimpleNamespace(rewards=torch.tensor([[2.0, 4.0]]), completions=comps(2, "length"))
    gathered = []
    dist = SimpleNamespace(gather=lambda mine: gathered.append(list(mine)) or [mine, [5.0, 5.0]])
    out = rollout_batch([(a, 0), (b, 0)], 2, "batch", dist)
    assert sorted(gathered[0]) == [0.0, 1.0, 2.0, 4.0]  # this rank's chosen rewards went to the gather
    assert out.advantages.tolist() == pytest.approx([0.233965, -0.233965, -0.467929, 0.467929], abs=1e-6)
    assert out.completions == a.completions[:2] + b.completions and out.truncated.tolist() == [False, False, True, True]
    # group scaling needs no gather: each group by its own std (1 0: 0.707107, 2 4: 1.414214), so
    # 0.5 / 0.707207 = 0.707007 and 1 / 1.414314 = 0.707057
    g = rollout_batch([(a, 0), (b, 0)], 2, "group", None)
    assert g.advantages.tolist() == pytest.approx([0.707007, -0.707007, -0.707057, 0.707057], abs=1e-6)


# ---- chunked logprobs ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_chunked_logprobs_and_grads_equal_a_full_forward(chunk):
    tr = _trainer("/tmp/unused")
    m = tr.model
    prompts, comps = [[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15, 16, 17, 18]]
    batch = pad_batch(prompts, comps)
    lp, ent = completion_logprobs(m, *batch, temperature=0.7, chunk=chunk)
    loss = lp.sum()
    loss.backward()
    g_chunk = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    ref_lp, ref_ent, tot = [], [], 0
    for p, c in zip(prompts, comps):
        logits = m(torch.tensor([p + c])).logits[0, len(p) - 1: -1].float() / 0.7
        ls = torch.log_softmax(logits, -1)
        tok = ls.gather(-1, torch.tensor(c)[:, None])[:, 0]
        ref_lp.append(tok)
        ref_ent.append(-(ls.exp() * ls).sum(-1))
        tot = tot + tok.sum()
    tot.backward()
    mask = batch[4]
    assert torch.allclose(lp[mask], torch.cat(ref_lp), atol=1e-5)
    assert torch.allclose(ent[mask], torch.cat(ref_ent).detach(), atol=1e-4)
    assert (lp[~mask] == 0).all()
    for n, p in m.named_parameters():
        if p.grad is not None:
            assert torch.allclose(g_chunk[n], p.grad, atol=1e-5), n


# ---- the loop -----------------------------------------------------------------------------------
def test_two_steps_write_metrics_checkpoints_and_a_peft_adapter(tmp_path):
    tr = _trainer(tmp_path, max_steps=2, save_steps=1, num_iterations=2, dynamic_sampling=False)
    before = _trainable(tr)
    rows = tr.train()
    for key in ("reward_mean", "reward_std", "accuracy", "rewards/sevens", "entropy", "completion_length_mean",
                "completion_length_max", "truncated_fraction", "clip_fraction", "grad_norm", "sigma", "aqn_stage",
                "lr", "rollout_tokens_per_s", "logprob_mismatch_mean", "logprob_mismatch_max",
                "filtered_group_fraction", "time_rollout", "time_logprob", "time_update"):
        assert key in rows[0] or key == "accuracy", key
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert rows[0]["updates"] == 2 * 16 // 8 and rows[0]["entropy"] > 0
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]
    assert any(not torch.equal(before[n], p) for n, p in _trainable(tr).items())
    # the adapter loads in PEFT's own config class, and the config file round-trips
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(str(tmp_path / "adapter")).r == 8
    assert GRPOConfig.from_yaml(tmp_path / "config.yaml") == tr.cfg


def test_resume_gives_identical_adapter_weights(tmp_path):
    kw = dict(num_iterations=2, lora_dropout=0.1, max_steps=4, save_steps=2)
    a = _trainer(tmp_path / "a", **kw)
    a.train()
    b = _trainer(tmp_path / "b", **kw)
    b.train(stop_after=2)
    c = _trainer(tmp_path / "b", **kw)
    assert c.resume() == 2
    c.train()
    wa, wc = _trainable(a), _trainable(c)
    assert all(torch.equal(wa[n], wc[n]) for n in wa)
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_crash_while_saving_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    tr = _trainer(tmp_path, max_steps=2, save_steps=1)
    tr.train(stop_after=1)
    calls = {"n": 0}
    real = ckpt.save_file

    def dying(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(*a, **k)

    monkeypatch.setattr(ckpt, "save_file", dying)
    with pytest.raises(OSError):
        tr.train()
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["checkpoint-1"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".checkpoint")]


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_checkpoint(tmp_path):
    tr = _trainer(tmp_path, max_steps=3, save_steps=1, dynamic_sampling=False)  # NaN weights give all-equal rewards
    tr.train(stop_after=1)
    with torch.no_grad():
        next(p for n, p in tr.model.named_parameters() if "lora_B" in n).fill_(float("nan"))
    with pytest.raises(TrainingError, match="checkpoint-1"):
        tr.train()
    assert [p.name for p in ckpt.checkpoints(tmp_path)] == ["checkpoint-1"]


def test_reward_time_limits_score_zero_and_are_counted(tmp_path):
    # a time limit is the machine's failure (rl/rewards.py): that completion scores 0, counted; any other
    # exception stops the run (tests/test_trl_refusals.py)
    def slow(completions, **_):
        out = []
        for c in completions:
            if sum(map(ord, c)) % 3 == 0:  # about a third of the completions, whatever they say
                raise TimeoutError("no result within 1 s")
            out.append(1.0)
        return out

    rows = _trainer(tmp_path, reward_funcs=(slow,), max_steps=1, dynamic_sampling=False).train()
    assert rows[0]["reward_errors"] > 0 and "no result within 1 s" in rows[0]["reward_first_error"]
    assert 0 <= rows[0]["reward_mean"] < 1


def test_dynamic_sampling_resamples_and_reports_filtered_groups(tmp_path):
    const = lambda completions, **_: [1.0] * len(completions)  # noqa: E731
    rows = _trainer(tmp_path, reward_funcs=(const,), max_steps=1, max_resample_rounds=2).train()
    assert rows[0]["rollout_rounds"] == 3 and rows[0]["filtered_group_fraction"] == 1.0
    assert rows[0]["updates"] == 0 and "grad_norm" not in rows[0]  # every advantage is 0: nothing to learn


def test_dynamic_sampling_trains_on_informative_groups_only(tmp_path):
    """DAPO: groups whose rewards are all equal are left out of the update (not padded back in)."""
    rows = _trainer(tmp_path, max_steps=3, max_resample_rounds=0).train()
    for r in rows:
        kept = round(16 / 4 * (1 - r["filtered_group_fraction"]))
        assert r["completions"] == 4 * kept
    assert any(0 < r["completions"] < 16 for r in rows)  # some groups were filtered, some kept


def lengths(completions, **_):
    return [float(len(c) % 3) for c in completions]  # varied within a group: every step trains


def test_kl_and_importance_sampling_options_run(tmp_path):
    rows = _trainer(tmp_path, max_steps=2, beta=0.05, importance_sampling_correction=True, loss_type="grpo",
                    mask_truncated_completions=True, scale_rewards="batch", reward_funcs=(lengths,)).train()
    # the reference is the base (adapters off): at the first update the policy is it (LoRA B = 0); at the second
    # it has trained away from it, so the step's mean KL is above 0 (a reference that followed the policy: 0)
    assert rows[0]["updates"] == 2 and rows[0]["kl"] > 0 and all(0 < r["is_weight_mean"] <= 3.0 for r in rows)  # importance_sampling_cap


# ---- configuration ------------------------------------------------------------------------------
def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="loss_type"):
        GRPOConfig(loss_type="ppo")
    with pytest.raises(ValueError, match="generation_batch_size"):
        GRPOConfig(generation_batch_size=30, num_generations=8)
    p = tmp_path / "c.yaml"
    p.write_text("learning_rat: 1e-5\n")
    with pytest.raises(ValueError, match=r"c.yaml: unknown field 'learning_rat' \(did you mean 'learning_rate'"):
        GRPOConfig.from_yaml(p)
    c = GRPOConfig().with_overrides({"learning_rate": "2e-5", "lora_target_modules": "q,v", "epsilon_high": "null"})
    assert c.learning_rate == 2e-5 and c.lora_target_modules == ["q", "v"] and c.epsilon_high is None
    with pytest.raises(ValueError, match="--max_steps"):
        GRPOConfig().with_overrides({"max_steps": "many"})


def test_train_norms_noise_in_training_and_gradient_checkpointing(tmp_path):
    tr = _trainer(tmp_path, max_steps=2, aqn_stages=2, train_norms=True, aqn_in_training=True,
                  gradient_checkpointing=True, save_steps=2)
    norms = {n: p.detach().clone() for n, p in tr.model.named_parameters() if n.endswith("layernorm.weight")}
    assert norms and all(p.requires_grad for n, p in tr.model.named_parameters() if n in norms)
    rows = tr.train()
    assert rows[1]["sigma"] > 0
    after = dict(tr.model.named_parameters())
    assert any(not torch.equal(norms[n], after[n]) for n in norms)  # trained (and the noise was restored)
    assert set(norms) <= set(ckpt.load_file(tmp_path / "checkpoint-2" / "trainable.safetensors"))


def test_the_shipped_yaml_documents_every_default():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    assert GRPOConfig.from_yaml(path) == GRPOConfig()
    # regenerate: python -c "from qerl.rl import GRPOConfig; print(GRPOConfig().to_yaml(), end='')" > configs/default.yaml
    assert path.read_text() == GRPOConfig().to_yaml()
    from qerl.rl.default_run import CPU, cpu_has_fast_bf16, default_run_config

    # = qerl train --device cpu --print_config on a CPU with native bf16 (elsewhere: fp32, fewer steps)
    run = path.parent / "default_run.yaml"
    assert run.read_text() == GRPOConfig(**CPU).to_yaml()
    cpu = default_run_config("cpu")
    assert cpu.dtype == ("bfloat16" if cpu_has_fast_bf16() else "float32")
    assert default_run_config("cuda").dtype == "auto"
