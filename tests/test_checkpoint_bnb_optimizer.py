"""A checkpoint holds the default optimizer's state: bitsandbytes' AdamW8bit (>= 0.48 nests its 8-bit states,
quantization maps and absmax in a dict per parameter), saved and restored so the next step is bit-identical.

Found on the GPU (test_trainer_gpu at b8030c1, H200, bitsandbytes 0.50.2): the first save raised
"Object of type Tensor is not JSON serializable". bitsandbytes' 8-bit AdamW also steps on the CPU, so the
real optimizer is tested here."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from qerl.train.checkpoints import load_checkpoint, save_checkpoint  # noqa: E402
from test_atomic_io import _policy  # noqa: E402


def _step(pol, opt):
    opt.zero_grad()
    pol.model(torch.arange(8)[None]).logits.pow(2).mean().backward()
    opt.step()


def test_adamw8bit_state_round_trips_and_the_next_step_is_identical(tmp_path):
    torch.manual_seed(0)
    pol = _policy(tmp_path)
    params = [p for p in pol.model.parameters() if p.requires_grad]
    # min_8bit_size 0: every tensor gets 8-bit states (the default keeps small ones in 32 bits)
    opt = bnb.optim.AdamW8bit(params, lr=1e-2, min_8bit_size=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    _step(pol, opt)
    nested = [v for st in opt.state_dict()["state"].values() for v in st.values() if isinstance(v, dict)]
    assert nested, "this bitsandbytes keeps no nested state: the case the test is for does not arise"
    folder = save_checkpoint(tmp_path / "run", 1, pol.model, opt, sched, {"data": {}})

    _step(pol, opt)  # the reference: the run continued without a restart
    want = {n: p.detach().clone() for n, p in pol.model.named_parameters() if p.requires_grad}

    pol2 = _policy(tmp_path)  # the restart: fresh model and optimizer, then the checkpoint
    params2 = [p for p in pol2.model.parameters() if p.requires_grad]
    opt2 = bnb.optim.AdamW8bit(params2, lr=1e-2, min_8bit_size=0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    load_checkpoint(folder, pol2.model, opt2, sched2)
    _step(pol2, opt2)
    got = dict(pol2.model.named_parameters())
    for n, w in want.items():
        assert torch.equal(got[n], w), n


def test_a_state_entry_no_checkpoint_can_hold_is_named(tmp_path):
    pol = _policy(tmp_path)
    params = [p for p in pol.model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    _step(pol, opt)
    opt.state[params[0]]["odd"] = object()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(TypeError, match=r"optimizer state state\.0\.odd is of type object"):
        save_checkpoint(tmp_path / "run", 1, pol.model, opt, sched, {"data": {}})
