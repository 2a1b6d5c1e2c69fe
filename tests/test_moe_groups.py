"""kernels/triton_moe_groups.py's pair groups against group_pairs_ref, on fresh random routings (Triton's interpreter
on the CPU, the compiled kernel on a GPU). Integer outputs: equal, not close."""

from __future__ import annotations

import pytest
import torch

from ftransformers.kernels.triton_moe_groups import group_leaders, group_pairs, group_pairs_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # on the CPU, conftest.py runs Triton's interpreter


def routing(t: int, e: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(t, e, generator=gen).topk(k, dim=-1).indices.to(DEV)  # k distinct experts a token


def check(ids: torch.Tensor, p: int) -> None:
    got, ref = group_pairs(ids, p).cpu(), group_pairs_ref(ids, p).cpu()
    assert torch.equal(got[:, :2], ref[:, :2])  # every row: leader's expert or -1, then the pair itself
    lead = ref[:, 0] >= 0
    assert torch.equal(got[lead], ref[lead])
    # each pair in exactly one group, of its own expert
    members = got[lead, 1:].reshape(-1)
    members = members[members >= 0].sort().values
    assert torch.equal(members, torch.arange(ids.numel(), dtype=torch.int32))
    flat = ids.reshape(-1).cpu()
    for row in got[lead]:
        assert all(flat[m].item() == row[0].item() for m in row[1:].tolist() if m >= 0)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize(("t", "e", "k"), [(1, 128, 8), (4, 128, 8), (16, 128, 8), (24, 128, 8), (5, 16, 8),
                                            (33, 8, 2), (3, 256, 8)])  # fmt: skip
def test_groups_match_reference(t: int, e: int, k: int, p: int) -> None:
    check(routing(t, e, k, seed=100 * t + 7 * e + p), p)


def test_one_expert_for_every_token() -> None:
    # 24 tokens all on the same 8 experts: 24 pairs an expert, 6 groups of 4 each
    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(s)) for s in range(24)]).to(DEV)
    check(ids, 4)
    got = group_pairs(ids, 4).cpu()
    assert int((got[:, 0] >= 0).sum()) == 8 * 6


def test_int32_ids() -> None:
    check(routing(16, 64, 4, seed=9).to(torch.int32), 2)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize(("t", "e", "k"), [(16, 128, 8), (64, 128, 8), (5, 16, 8), (33, 8, 2)])
def test_leaders_list_the_groups_in_pair_order(t: int, e: int, k: int, p: int) -> None:
    ids = routing(t, e, k, seed=13 * t + e + p)
    groups = group_pairs(ids, p)
    got = group_leaders(groups).cpu()
    lead = torch.nonzero(group_pairs_ref(ids, p)[:, 0] >= 0).flatten().to(torch.int32).cpu()
    assert int(got[0]) == lead.numel() and torch.equal(got[1 : 1 + lead.numel()], lead)
