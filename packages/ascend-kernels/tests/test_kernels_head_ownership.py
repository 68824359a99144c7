# SPDX-License-Identifier: Apache-2.0
"""Head ownership: which TP rank holds which KV heads, and the slices ranks exchange."""
from __future__ import annotations

import pytest

from vllm_ascend.distributed.kernels import (
    HeadSlice,
    KernelShapeError,
    head_group_of_rank,
    kv_heads_of_rank,
    num_head_groups,
    partners_per_remote_rank,
    plan_head_slices,
)


@pytest.mark.parametrize(("heads", "tp"), [(8, 1), (8, 2), (8, 4), (8, 8), (2, 4), (1, 4),
                                           (4, 8)])
def test_every_head_has_an_owner_and_ranges_tile(heads: int, tp: int) -> None:
    owned = [kv_heads_of_rank(heads, tp, r) for r in range(tp)]
    covered = sorted({h for r in owned for h in r})
    assert covered == list(range(heads))
    if heads >= tp:  # a partition: disjoint, equal, in rank order
        assert [h for r in owned for h in r] == list(range(heads))
    else:  # replicated: tp // heads consecutive ranks share one head
        assert all(len(r) == 1 for r in owned)
        assert [r.start for r in owned] == [t // (tp // heads) for t in range(tp)]


@pytest.mark.parametrize(("heads", "tp", "rank"), [(6, 4, 0), (3, 4, 1), (4, 2, 2), (4, 2, -1)])
def test_uneven_split_or_bad_rank_is_a_shape_error(heads: int, tp: int, rank: int) -> None:
    with pytest.raises(KernelShapeError):
        kv_heads_of_rank(heads, tp, rank)


@pytest.mark.parametrize(("heads", "remote_tp", "local_tp"),
                         [(8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 4), (2, 4, 1), (2, 1, 4),
                          (4, 4, 4)])
def test_plans_cover_each_local_head_once_from_a_holder(heads: int, remote_tp: int,
                                                        local_tp: int) -> None:
    for rank in range(local_tp):
        mine = kv_heads_of_rank(heads, local_tp, rank)
        got: list[int] = []
        for s in plan_head_slices(heads, remote_tp, local_tp, rank):
            theirs = kv_heads_of_rank(heads, remote_tp, s.remote_rank)
            for i in range(s.num_heads):
                head = mine.start + s.local_offset + i
                assert theirs.start + s.remote_offset + i == head
                got.append(head)
        assert got == list(mine)


def test_mla_pairs_whole_blocks_with_one_remote_rank() -> None:
    assert plan_head_slices(1, 2, 4, 3, is_mla=True) == [HeadSlice(1, 0, 0, 1)]
    assert partners_per_remote_rank(1, 2, 4, is_mla=True) == {0: 2, 1: 2}


def test_partners_count_each_local_rank_once_per_remote_rank() -> None:
    # P TP 2 -> D TP 1: the single D rank reads both P ranks
    assert partners_per_remote_rank(8, 2, 1) == {0: 1, 1: 1}
    # P TP 1 -> D TP 4: all four D ranks read P rank 0
    assert partners_per_remote_rank(8, 1, 4) == {0: 4}


@pytest.mark.parametrize(("tp", "heads"), [(1, 8), (4, 8), (8, 2), (4, 1), (2, 2)])
def test_head_groups_share_heads(tp: int, heads: int) -> None:
    groups = {}
    for rank in range(tp):
        group, step = head_group_of_rank(rank, tp, heads)
        groups.setdefault(group, []).append(rank)
        assert step == max(1, tp // heads)
        assert kv_heads_of_rank(heads, tp, rank) == kv_heads_of_rank(heads, tp, groups[group][0])
    assert len(groups) == num_head_groups(tp, heads)
    with pytest.raises(KernelShapeError):
        head_group_of_rank(0, 0, 4)


@pytest.mark.parametrize(("heads", "remote_tp", "local_tp"),
                         [(8, 4, 2), (8, 2, 1), (12, 3, 2), (8, 1, 2), (2, 1, 4)])
def test_merge_head_slices_rebuilds_the_local_heads(heads: int, remote_tp: int,
                                                    local_tp: int) -> None:
    import torch

    from vllm_ascend.distributed.kernels import merge_head_slices

    n, block, size = 3, 4, 2
    # the global cache in the NPU layout (n, block_size, heads, head_size), heads numbered
    full = torch.arange(n * block * heads * size, dtype=torch.float32).reshape(
        n, block, heads, size)
    remote = {r: full[:, :, kv_heads_of_rank(heads, remote_tp, r).start:
                      kv_heads_of_rank(heads, remote_tp, r).stop].contiguous()
              for r in range(remote_tp)}
    for rank in range(local_tp):
        mine = kv_heads_of_rank(heads, local_tp, rank)
        slices = plan_head_slices(heads, remote_tp, local_tp, rank)
        used = {s.remote_rank: remote[s.remote_rank] for s in slices}
        merged = merge_head_slices(used, slices, head_axis=1)
        assert torch.equal(merged, full[:, :, mine.start:mine.stop])
    with pytest.raises(KernelShapeError, match="no blocks of remote ranks"):
        merge_head_slices({}, plan_head_slices(heads, remote_tp, local_tp, 0), head_axis=1)
