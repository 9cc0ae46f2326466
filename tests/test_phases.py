"""The trainer's phase plumbing: the profiler, adapters-off switching, the micro-batches."""

import pytest
import torch

from qerl.layers import QLoRALinear, adapters_disabled
from qerl.train.batch import RolloutBatch, micro_batches
from qerl.train.profiling import Profiler
from qerl.completion import Completion


def test_profiler_times_nested_and_repeated_phases_and_tells_listeners():
    prof, heard = Profiler(), []
    prof.listeners.append(lambda name, event: heard.append((name, event)))
    with prof.phase("rollout"):
        for _ in range(2):
            with prof.phase("rewards"):
                pass
    assert heard == [("rollout", "start"), ("rewards", "start"), ("rewards", "end"), ("rewards", "start"),
                     ("rewards", "end"), ("rollout", "end")]
    t = prof.take()
    assert set(t) == {"time_rollout", "time_rewards"} and t["time_rollout"] >= t["time_rewards"] > 0
    assert prof.take() == {}  # each step starts afresh
    with pytest.raises(KeyError), prof.phase("update"):  # a failing phase is still timed and ended
        raise KeyError
    assert heard[-1] == ("update", "end") and "time_update" in prof.take()


def test_adapters_disabled_gives_the_base_layer_and_restores_the_adapter():
    torch.manual_seed(0)
    w = torch.randn(24, 64, dtype=torch.float64)
    layer = QLoRALinear.from_weight(w, "nvfp4", r=4, lora_alpha=8, dtype=torch.float64)
    torch.nn.init.normal_(layer.lora_B.weight)
    model = torch.nn.Sequential(layer)
    x = torch.randn(3, 64, dtype=torch.float64)
    base = x @ layer.dequantized_weight(torch.float64).T  # independent reference: the dequantized matmul
    on = model(x)
    with adapters_disabled(model):
        assert torch.allclose(model(x), base, atol=1e-10)
    assert torch.allclose(model(x), on) and not torch.allclose(on, base)
    with pytest.raises(RuntimeError), adapters_disabled(model):
        raise RuntimeError  # restored on the way out of an error too
    assert not layer.disable_adapters


def test_micro_batches_place_each_rollout_logprob_under_its_token():
    comps = [Completion(0, j, [5, 6, 7][: 1 + j], list(range(10, 10 + n)), [-0.1 * (j + 1) * (k + 1) for k in range(n)],
                        "eos") for j, n in enumerate([3, 1, 2])]
    batch = RolloutBatch(comps, torch.tensor([1.0, -1.0, 0.5]), torch.tensor([False, True, False]))
    mbs = micro_batches(batch, 2, pad_id=0, device="cpu")
    assert [len(m.advantages) for m in mbs] == [2, 1]
    for s, m in zip((0, 2), mbs):
        for i in range(len(m.advantages)):
            c = comps[s + i]
            n = len(c.token_ids)
            assert m.mask[i].sum() == n and m.targets[i, :n].tolist() == c.token_ids
            assert m.rollout_logprobs[i, :n].tolist() == pytest.approx(c.logprobs)
            assert m.input_ids[i, : len(c.prompt_ids) + n].tolist() == c.prompt_ids + c.token_ids
            assert m.advantages[i] == batch.advantages[s + i] and m.truncated[i] == batch.truncated[s + i]
