# SPDX-License-Identifier: Apache-2.0
"""The P/D workers' head plan: ascend-kernels' head ownership, with the P/D error.

``worker_base.head_slices`` / ``head_partners`` are
:func:`~vllm_ascend.distributed.kernels.heads.plan_head_slices` /
``partners_per_remote_rank``; heads that do not split over a TP size are the
connectors' :class:`HandshakeMismatchError` (what the old ``tp_plan`` raised).
"""
from __future__ import annotations

import pytest

from vllm_ascend.distributed.kernels.heads import kv_heads_of_rank
from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import HandshakeMismatchError
from vllm_ascend.distributed.kv_transfer.kv_p2p.worker_base import head_partners, head_slices

CASES = [(h, p, d) for h in (1, 2, 4, 8) for p in (1, 2, 4, 8) for d in (1, 2, 4, 8)
         if (h % p == 0 or p % h == 0) and (h % d == 0 or d % h == 0)]


def test_heads_of_rank() -> None:
    assert list(kv_heads_of_rank(8, 4, 1)) == [2, 3]
    assert list(kv_heads_of_rank(2, 8, 5)) == [1]  # replicated heads
    with pytest.raises(ValueError):
        kv_heads_of_rank(6, 4, 0)
    with pytest.raises(ValueError):
        kv_heads_of_rank(8, 4, 4)


def test_uneven_heads_are_a_handshake_mismatch() -> None:
    with pytest.raises(HandshakeMismatchError):
        head_slices(6, 4, 1, 0)
    with pytest.raises(HandshakeMismatchError):
        head_slices(8, 1, 4, 4)  # a rank outside the TP size
    with pytest.raises(HandshakeMismatchError):
        head_partners(6, 4, 1)


@pytest.mark.parametrize(("heads", "p_tp", "d_tp"), CASES)
def test_every_d_rank_gets_exactly_its_heads_from_holders(heads: int, p_tp: int, d_tp: int) -> None:
    for d in range(d_tp):
        mine = kv_heads_of_rank(heads, d_tp, d)
        got: list[int] = []
        for s in head_slices(heads, p_tp, d_tp, d):
            theirs = kv_heads_of_rank(heads, p_tp, s.remote_rank)
            for k in range(s.num_heads):
                # the remote head at remote_offset+k is the global head we put at local_offset+k
                assert theirs[s.remote_offset + k] == mine[s.local_offset + k]
                got.append(mine[s.local_offset + k])
        assert got == list(mine)
    readers = head_partners(heads, p_tp, d_tp)
    assert sum(readers.values()) == sum(
        len({s.remote_rank for s in head_slices(heads, p_tp, d_tp, d)}) for d in range(d_tp))


def test_p_tp_multiple_of_d_tp_reads_several_p_ranks() -> None:
    plan = head_slices(8, 4, 1, 0)
    assert [(s.remote_rank, s.local_offset, s.remote_offset, s.num_heads) for s in plan] == [
        (0, 0, 0, 2), (1, 2, 0, 2), (2, 4, 0, 2), (3, 6, 0, 2)]
    assert head_partners(8, 4, 1) == {0: 1, 1: 1, 2: 1, 3: 1}


def test_d_tp_larger_reads_a_slice() -> None:
    plan = head_slices(8, 1, 4, 3)
    assert [(s.remote_rank, s.local_offset, s.remote_offset, s.num_heads) for s in plan] == [
        (0, 0, 6, 2)]
    assert head_partners(8, 1, 4) == {0: 4}


def test_mla_reads_whole_blocks_from_one_rank() -> None:
    assert [s.remote_rank for d in range(4)
            for s in head_slices(1, 2, 4, d, is_mla=True)] == [0, 1, 0, 1]
    assert head_partners(1, 2, 4, is_mla=True) == {0: 2, 1: 2}
