"""The GPU memory cap: allocations past it fail as on a smaller card; budgets read what it leaves."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)

from qerl.device_memory import free_bytes, memory_cap, set_memory_cap  # noqa: E402
from qerl.model import qwen25_config, random_policy  # noqa: E402
from qerl.rollout import Engine  # noqa: E402


@pytest.fixture
def cap_gib():
    torch.cuda.empty_cache()
    gib = torch.cuda.memory_reserved() / 2**30 + 3.0
    set_memory_cap(gib)
    yield gib
    set_memory_cap(None)
    torch.cuda.empty_cache()


def test_allocation_past_the_cap_fails(cap_gib):
    assert memory_cap() == int(cap_gib * 2**30)
    assert free_bytes() <= 3.0 * 2**30 + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    keep = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")  # under the cap
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")  # 4 GiB would pass it
    del keep


def test_engine_kv_budget_honours_the_cap(cap_gib):
    pol = random_policy(qwen25_config("qwen2.5-0.5b", 2), "nvfp4", lora_rank=8, progress=False)
    eng = Engine(pol.model, max_len=512, max_slots=10**6)  # default budget: half of what is free
    assert eng.cache.nbytes() <= 3.0 * 2**30 / 2  # without the cap: half of the whole free card
