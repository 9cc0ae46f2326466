"""AQN on every family (issue 48.5): where the norm before q/k/v or gate/up is not Llama-form (Gemma 3's
(1 + w), Olmo/gpt-oss's (w * x_hat).to(dtype)) or there is none (Olmo 2's post-norms), the projection
group's input gets the same multiplicative noise (1 + Z/w_eff) per input channel; the engine samples
under the noise the trainer's forward sees; GRPO trains with the default AQN on."""

import pytest
import torch

from qerl.model import random_policy
from qerl.model.random_init import moe_config
from qerl.rl import GRPOConfig, GRPOTrainer
from qerl.rl.aqn import AQN
from qerl.rollout import Engine, SamplingParams
from qerl.tasks import get_task
from test_families import family_config

FAMILIES = ["gemma3", "olmo2", "gpt_oss"]
# (block, its projection AQN noises, the norm before it or None): the reference reads the family
# description of transformers' layers, written out here rather than taken from model/family.py
LAYOUT = {
    "gemma3": [("self_attn", "q_proj", "input_layernorm"), ("mlp", "gate_proj", "pre_feedforward_layernorm")],
    "olmo2": [("self_attn", "q_proj", None), ("mlp", "gate_proj", None)],
    "gpt_oss": [("self_attn", "q_proj", "input_layernorm")],  # the MoE block (router, experts) is left clean
}


def _config(family):
    if family == "gpt_oss":
        return moe_config("gpt-oss-tiny")
    return family_config(family)


def _policy(family, seed=0):
    torch.manual_seed(seed)
    pol = random_policy(_config(family), "nvfp4", lora_rank=4, device="cpu", dtype=torch.float32, std=0.08,
                        progress=False)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # norm weights away from their init, so w_eff differs per channel
        for name, p in pol.model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return pol


def _w_eff(family, norm):
    w = norm.weight.double()
    return 1 + w if family == "gemma3" else w  # Gemma3RMSNorm computes x_hat * (1 + w)


def _x_hat(x, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("family", FAMILIES)
def test_noise_multiplies_each_projection_input_by_one_plus_z_over_w(family):
    m = _policy(family).model
    aqn = AQN(m)
    layer0 = m.model.layers[0]
    seen, hooks = {}, []
    for block, proj, norm in LAYOUT[family]:
        site = getattr(layer0, block) if norm is None else getattr(layer0, norm)
        hooks.append(site.register_forward_pre_hook(
            lambda mod, a, kw, k=block: seen.__setitem__((k, "site"), (a or (kw["hidden_states"],))[0].detach()),
            with_kwargs=True))
        hooks.append(getattr(getattr(layer0, block), proj).register_forward_pre_hook(
            lambda mod, a, k=block: seen.__setitem__((k, "proj"), a[0].detach())))
    ids = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(3))
    with aqn.applied(0.05, seed=7), torch.no_grad():
        m(ids)
        noise = {k: z.double() for k, z in aqn.noise.items()}  # the buffers are zeroed when the block ends
    for h in hooks:
        h.remove()
    names = {f"model.layers.0.{b if n is None else n}" for b, _, n in LAYOUT[family]}
    assert names == {k for k in aqn.noise if k.startswith("model.layers.0.")}
    for block, _, norm in LAYOUT[family]:
        x, got = seen[(block, "site")], seen[(block, "proj")].double()
        if norm is None:  # no norm: the block's input times (1 + Z), a norm of weight 1 noised
            z = noise[f"model.layers.0.{block}"]
            clean, want = x.double(), x.double() * (1 + z)
        else:
            mod = getattr(layer0, norm)
            z = noise[f"model.layers.0.{norm}"]
            clean = _x_hat(x, aqn.eps[f"model.layers.0.{norm}"]) * _w_eff(family, mod)
            want = clean * (1 + z / _w_eff(family, mod))  # the paper's row-wise (1 + Z/w)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (family, block)
        # and the noise is there: the change is of relative size ~ sigma / |w_eff|
        rel = ((got - clean).norm() / clean.norm()).item()
        assert 0.01 < rel < 0.2, (family, block, rel)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_samples_under_the_noise_the_trainers_forward_sees(family):
    """The engine (prefill through the modules, decode through the glue) against the trainer's
    teacher-forced forward in the same noisy block, then both without noise."""
    m = _policy(family).model
    aqn = AQN(m)  # before the engine, as the trainer builds it
    eng = Engine(m, max_len=96, max_slots=4, sync_every=4)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 41))]
    p = SamplingParams(max_new_tokens=10, temperature=1.0, seed=1)
    with aqn.applied(5e-2, seed=9):
        outs = eng.generate(prompts, n=2, params=p)
        noisy = [_teacher_forced(m, c) for c in outs]
    clean = [_teacher_forced(m, c) for c in outs]
    assert _worst(outs, noisy) < 1e-4, family
    assert _worst(outs, clean) > 1e-3, family  # the noise moved the logprobs: it reached the engine
    outs = eng.generate(prompts, n=2, params=p)
    assert _worst(outs, [_teacher_forced(m, c) for c in outs]) < 1e-4  # and is gone after the block


def _worst(outs, ref):
    return max((torch.tensor(c.logprobs) - r).abs().max().item() for c, r in zip(outs, ref))


def _teacher_forced(m, c):
    seq = torch.tensor([c.prompt_ids + c.token_ids])
    with torch.no_grad():
        lg = m(seq).logits[0, len(c.prompt_ids) - 1: -1].float()
    return torch.log_softmax(lg, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]


def _sevens(completions, **_):
    return [sum(map(ord, c)) % 7 / 7 for c in completions]


@pytest.mark.parametrize("family, in_training", [("gemma3", False), ("olmo2", True), ("gpt_oss", False)])
def test_grpo_trains_two_steps_with_the_default_aqn(family, in_training, tmp_path):
    """Default AQN (on, exponential, sigma 1e-2 -> 5e-4): over 2 steps the second is noisy; olmo2 also
    noises the update's passes (aqn_in_training), the path through its blocks' own forward."""
    from tiny_models import tiny_tokenizer

    pol = _policy(family)
    tok = tiny_tokenizer()
    pol.tokenizer = tok
    cfg = GRPOConfig(max_steps=2, generation_batch_size=8, num_generations=4, per_device_train_batch_size=4,
                     gradient_accumulation_steps=2, max_completion_length=8, max_prompt_length=64,
                     learning_rate=1e-2, aqn_in_training=in_training, output_dir=str(tmp_path / "run"),
                     save_steps=10, report_to="none", device="cpu", dynamic_sampling=False)
    assert cfg.aqn
    tr = GRPOTrainer(cfg, policy=pol, task=get_task("arithmetic", size=16), reward_funcs=[_sevens], progress=False)
    before = {n: p.detach().clone() for n, p in pol.model.named_parameters() if p.requires_grad}
    rows = tr.train()
    assert rows[0]["sigma"] == 0.0 and rows[1]["sigma"] == pytest.approx(1e-2)
    assert rows[1]["aqn_sigma_effective"] == pytest.approx(1e-2, rel=0.3)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    after = dict(pol.model.named_parameters())
    assert any(not torch.equal(before[n], after[n].detach()) for n in before)
    assert all(not z.any() for z in tr.aqn.noise.values())  # the buffers are zero after the steps
