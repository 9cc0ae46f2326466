"""The humming MoE candidate's routing layout (kernels/humming_moe.py) on the CPU, against a plain per-expert loop
written from vLLM's moe_align_block_size contract: each expert's (token, slot) pair ids in ascending order, padded
to a multiple of the block with the id T*k, one expert id a block, unchosen experts absent."""

import pytest
import torch

from qerl.kernels.humming_moe import align, combine


def _reference(topk_ids, num_experts, block):
    flat = topk_ids.reshape(-1).tolist()
    pad = len(flat)
    ids, experts = [], []
    for e in range(num_experts):
        mine = [i for i, x in enumerate(flat) if x == e]
        blocks = -(-len(mine) // block)
        ids += mine + [pad] * (blocks * block - len(mine))
        experts += [e] * blocks
    return ids, experts


@pytest.mark.parametrize("t,k,e,block", [(1, 8, 128, 16), (5, 2, 8, 4), (64, 8, 128, 64), (33, 4, 16, 1)])
def test_align_lays_the_pairs_out_per_expert_in_padded_blocks(t, k, e, block):
    g = torch.Generator().manual_seed(t * k + e)
    topk = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    a = align(topk, e, block)
    ids, experts = _reference(topk, e, block)
    assert a.sorted_ids.dtype == torch.int32 and a.sorted_ids.tolist() == ids
    assert a.expert_ids.tolist() == experts and int(a.num_tokens_padded) == len(ids)
    assert len(ids) % block == 0 and len(experts) * block == len(ids)


def test_pairs_routed_to_no_expert_take_no_row_and_add_nothing():
    topk = torch.tensor([[0, 4], [2, 0], [4, 4]])  # 4 experts: the id 4 is "no expert"
    a = align(topk, 4, 2)
    ids, experts = _reference(topk, 4, 2)  # the loop covers experts 0-3 only
    assert a.sorted_ids.tolist() == ids == [0, 3, 2, 6] and a.expert_ids.tolist() == experts == [0, 2]
    rows = torch.full((6, 3), float("nan"))  # unwritten rows may hold anything
    rows[0], rows[3], rows[2] = 1.0, 2.0, 3.0
    w = torch.full((3, 2), 0.5)
    got = combine(rows, w, torch.float32, topk < 4)
    assert torch.equal(got, torch.tensor([[0.5] * 3, [2.5] * 3, [0.0] * 3]))


def test_combine_weights_each_tokens_rows_and_sums_them():
    rows = torch.arange(2 * 3 * 4, dtype=torch.float32).view(6, 4)
    w = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]])
    got = combine(rows, w, torch.float32)
    want = torch.stack([0.5 * rows[0] + 0.25 * rows[1] + 0.25 * rows[2], rows[3]])
    assert torch.allclose(got, want)
