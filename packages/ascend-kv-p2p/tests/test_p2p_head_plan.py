# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest

from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import HandshakeMismatchError
from vllm_ascend.distributed.kv_transfer.kv_p2p.tp_plan import (
    kv_heads_of_rank,
    plan_pulls,
    readers_per_p_rank,
)

CASES = [(h, p, d) for h in (1, 2, 4, 8) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)
         if (h % p == 0 or p % h == 0) and (h % d == 0 or d % h == 0)]


def test_heads_of_rank() -> None:
    assert list(kv_heads_of_rank(8, 4, 1)) == [2, 3]
    assert list(kv_heads_of_rank(2, 8, 5)) == [1]  # replicated heads
    with pytest.raises(HandshakeMismatchError):
        kv_heads_of_rank(6, 4, 0)
    with pytest.raises(ValueError):
        kv_heads_of_rank(8, 4, 4)


@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), CASES)
def test_every_d_rank_gets_exactly_its_heads_from_holders(heads: int, p_tp: int, d_tp: int) -> None:
    for d in range(d_tp):
        mine = kv_heads_of_rank(heads, d_tp, d)
        got: list[int] = []
        for s in plan_pulls(heads, p_tp, d_tp, d):
            theirs = kv_heads_of_rank(heads, p_tp, s.p_rank)
            for k in range(s.num_heads):
                # the remote head at remote_offset+k is the global head we put at local_offset+k
                assert theirs[s.remote_offset + k] == mine[s.local_offset + k]
                got.append(mine[s.local_offset + k])
        assert got == list(mine)
    readers = readers_per_p_rank(heads, p_tp, d_tp)
    assert sum(readers.values()) == sum(
        len({s.p_rank for s in plan_pulls(heads, p_tp, d_tp, d)}) for d in range(d_tp))


def test_p_tp_multiple_of_d_tp_reads_several_p_ranks() -> None:
    plan = plan_pulls(8, 4, 1, 0)
    assert [(s.p_rank, s.local_offset, s.remote_offset, s.num_heads) for s in plan] == [
        (0, 0, 0, 2), (1, 2, 0, 2), (2, 4, 0, 2), (3, 6, 0, 2)]
    assert readers_per_p_rank(8, 4, 1) == {0: 1, 1: 1, 2: 1, 3: 1}


def test_d_tp_larger_reads_a_slice() -> None:
    plan = plan_pulls(8, 1, 4, 3)
    assert [(s.p_rank, s.local_offset, s.remote_offset, s.num_heads) for s in plan] == [
        (0, 0, 6, 2)]
    assert readers_per_p_rank(8, 1, 4) == {0: 4}


def test_mla_reads_whole_blocks_from_one_rank() -> None:
    assert [s.p_rank for d in range(4) for s in plan_pulls(1, 2, 4, d, is_mla=True)] == [0, 1, 0, 1]
    assert readers_per_p_rank(1, 2, 4, is_mla=True) == {0: 2, 1: 2}
