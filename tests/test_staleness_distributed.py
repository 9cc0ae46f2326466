"""max_staleness 1 over two gloo ranks: the rollout is joined where it is needed (its collectives must not
meet the update's), and the run equals one process doing the same global batch, as the synchronous one does."""

import torch
from safetensors.torch import load_file

from test_distributed import BASE, _metrics, _run

STALE = {**BASE, "max_staleness": 1, "max_steps": 3}


def test_two_ranks_with_staleness_1_equal_one_process(tmp_path):
    dp, one = tmp_path / "dp", tmp_path / "one"
    p, _ = _run(dp, STALE, nproc=2)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    p, _ = _run(one, {**STALE, "gradient_accumulation_steps": 4})
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = (load_file(str(dp / f"adapter_rank{r}.safetensors")) for r in (0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    o = load_file(str(one / "adapter_rank0.safetensors"))
    for k in o:
        torch.testing.assert_close(a[k], o[k], rtol=1e-4, atol=1e-6)
    assert [m["staleness"] for m in _metrics(dp)] == [0, 1, 1]
    # a checkpoint with the next rollout in flight, written by rank 0
    assert (dp / "checkpoint-2" / "rollout_adapter.safetensors").exists()  # (the last, checkpoint-3, has none)
    assert not (dp / "checkpoint-3" / "rollout_adapter.safetensors").exists()
