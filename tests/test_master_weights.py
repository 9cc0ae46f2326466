"""fp32 master weights for low-precision LoRA factors (rl/optim.MasterWeights; lora_dtype: float32 on a GPU).

References: torch AdamW stepping fp32 tensors directly, given the same gradients; the trainer's own
checkpoint/resume path for exactness.
"""

import pytest
import torch
from test_lora_dtype import _trainer

from qerl.train.optim import MasterWeights, lr_lambda, make_optimizer


def _adamw(params, lr=1e-5):
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0)


def test_masters_follow_an_fp32_adamw_and_the_live_tensors_round_them():
    g = torch.Generator().manual_seed(0)
    ref = [torch.randn(8, 64, generator=g) * 0.1, torch.randn(64, 8, generator=g) * 0.01]
    live = [t.to(torch.bfloat16).requires_grad_(True) for t in ref]
    ref = [t.to(torch.bfloat16).float().requires_grad_(True) for t in ref]  # the same starting values
    opt, ref_opt = MasterWeights(live, _adamw), _adamw(ref)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0 / (u + 1))
    start = [p.detach().clone() for p in live]
    for _ in range(5):
        for p, r in zip(live, ref):
            grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            p.grad, r.grad = grad, grad.float()
        opt.step()
        ref_opt.step()
        sched.step()
        for grp in ref_opt.param_groups:
            grp["lr"] = opt.param_groups[0]["lr"]  # the reference follows the same schedule
        opt.zero_grad()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5 / 6)  # the schedule drives the inner optimizer
    for m, p, r, s in zip(opt.masters, live, ref, start):
        assert torch.equal(m, r.detach())  # the same fp32 trajectory
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))  # the live tensor is its rounding
        assert p.grad is None and m.grad is None
    # steps of ~1e-5 against bf16 spacings of ~5e-4 at |A| ~ 0.1: the masters moved, most live A elements did not
    assert (opt.masters[0] != start[0].float()).float().mean() > 0.9
    assert (live[0].detach() != start[0]).float().mean() < 0.05


def test_trainer_with_master_weights_resumes_exactly(tmp_path):
    def build(out):
        # bf16 factors (lora_dtype auto) under bf16 compute, the master weights put in by hand (the trainer
        # chooses them on CUDA only)
        tr = _trainer(out, max_steps=3, save_steps=1, learning_rate=1e-4)
        tr.optimizer, tr.optim_name = make_optimizer(tr.cfg, tr.params, tr.device, master_weights=True)
        tr.scheduler = torch.optim.lr_scheduler.LambdaLR(tr.optimizer, lr_lambda(tr.cfg, tr.cfg.max_steps))
        assert isinstance(tr.optimizer, MasterWeights) and "fp32 master" in tr.optim_name
        assert all(p.dtype == torch.bfloat16 for p in tr.params)
        return tr

    a = build(tmp_path / "a")
    a.train()
    assert (tmp_path / "a" / "checkpoint-2").exists()
    b = build(tmp_path / "a")
    assert b.resume(tmp_path / "a" / "checkpoint-2") == 2
    for mb, p in zip(b.optimizer.masters, b.params):
        assert mb.dtype == torch.float32 and torch.equal(p.detach(), mb.detach().to(p.dtype))
    b.train()
    for ma, mb in zip(a.optimizer.masters, b.optimizer.masters):
        assert torch.equal(ma, mb)  # step 3 from the checkpoint = step 3 of the uninterrupted run
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa, pb)


def test_state_without_masters_is_refused():
    live = [torch.zeros(4, 4, dtype=torch.bfloat16, requires_grad=True)]
    plain = _adamw([torch.zeros(4, 4, requires_grad=True)])
    with pytest.raises(ValueError, match="master"):
        MasterWeights(live, _adamw).load_state_dict(plain.state_dict() | {"state": {0: {}}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the master-weight path is chosen on CUDA")
def test_cuda_trainer_keeps_bf16_factors_and_steps_fp32_masters(tmp_path):
    from qerl.layers import QLoRALinear

    tr = _trainer(tmp_path, device="cuda", lora_dtype="float32", optim="adamw_torch")
    assert isinstance(tr.optimizer, MasterWeights)
    layers = [m for m in tr.model.modules() if isinstance(m, QLoRALinear) and m.r]
    assert all(m.lora_A.weight.dtype == torch.bfloat16 for m in layers)
    before = [m.detach().clone() for m in tr.optimizer.masters]
    tr.train()
    moved = sum(int((m != b).sum()) for m, b in zip(tr.optimizer.masters, before)) / sum(b.numel() for b in before)
    assert moved > 0.5
    for m, p in zip(tr.optimizer.masters, tr.params):
        assert torch.equal(p.detach(), m.detach().to(p.dtype))
