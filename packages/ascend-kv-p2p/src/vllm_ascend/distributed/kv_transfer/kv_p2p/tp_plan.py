# SPDX-License-Identifier: Apache-2.0
"""Which prefill ranks a decode rank reads, and which heads, under heterogeneous TP.

With ``H`` KV heads and tensor-parallel size ``T``, rank ``t`` holds heads
``[t*H/T, (t+1)*H/T)`` when ``H >= T``; when ``H < T`` heads are replicated
and rank ``t`` holds head ``t // (T/H)``. A D rank needs the heads it holds;
it reads each from a P rank holding it (spreading over replicas), as
contiguous head slices. MLA caches have no head axis: every rank holds the
same latent KV, so a D rank reads whole blocks from one P rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import HandshakeMismatchError


def kv_heads_of_rank(total_heads: int, tp_size: int, tp_rank: int) -> range:
    """Global KV head indices held by ``tp_rank`` of ``tp_size``."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise HandshakeMismatchError(
                f"{total_heads} KV heads cannot be split evenly over TP size {tp_size}")
        per = total_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_heads:
        raise HandshakeMismatchError(
            f"TP size {tp_size} is not a multiple of the {total_heads} KV heads")
    head = tp_rank // (tp_size // total_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class PullSlice:
    """Heads ``[local_offset, local_offset + num_heads)`` of this rank's blocks come from
    heads ``[remote_offset, ...)`` of P rank ``p_rank``'s blocks."""

    p_rank: int
    local_offset: int
    remote_offset: int
    num_heads: int


def plan_pulls(total_heads: int, p_tp: int, d_tp: int, d_rank: int, *,
               is_mla: bool = False) -> list[PullSlice]:
    """The slices D rank ``d_rank`` reads, grouped by P rank."""
    if is_mla:
        return [PullSlice(p_rank=d_rank % p_tp, local_offset=0, remote_offset=0, num_heads=1)]
    mine = kv_heads_of_rank(total_heads, d_tp, d_rank)
    holders = {r: kv_heads_of_rank(total_heads, p_tp, r) for r in range(p_tp)}
    slices: list[PullSlice] = []
    for h in mine:
        candidates = [r for r, heads in holders.items() if h in heads]
        p_rank = candidates[d_rank % len(candidates)]
        local, remote = h - mine.start, h - holders[p_rank].start
        last = slices[-1] if slices else None
        if (last and last.p_rank == p_rank and last.local_offset + last.num_heads == local
                and last.remote_offset + last.num_heads == remote):
            slices[-1] = PullSlice(p_rank, last.local_offset, last.remote_offset,
                                   last.num_heads + 1)
        else:
            slices.append(PullSlice(p_rank, local, remote, 1))
    return slices


def readers_per_p_rank(total_heads: int, p_tp: int, d_tp: int, *,
                       is_mla: bool = False) -> dict[int, int]:
    """How many D ranks read from each P rank (P frees after that many ``Done``)."""
    counts: dict[int, int] = {}
    for d in range(d_tp):
        for p in {s.p_rank for s in plan_pulls(total_heads, p_tp, d_tp, d, is_mla=is_mla)}:
            counts[p] = counts.get(p, 0) + 1
    return counts
