# SPDX-License-Identifier: Apache-2.0
"""Which blocks of each KV cache group a pull moves, under vLLM's hybrid KV cache manager.

With several groups (full attention and sliding window,
:mod:`~vllm_ascend.distributed.kv_transfer.core.kv_groups`), a request has one list of block
ids per group, by position. P holds, of every group, the blocks from the first one its manager
still keeps to the end of the prompt (a window's group has vLLM's null block before that), and
says where each group's run starts (``remote_block_groups``: ``[first position, count]`` per
group) beside the runs themselves, one after another (``remote_block_ids``). D reads, of every
group, the positions its own manager keeps (a window's, not the whole prompt's), each into the
block it allocated at that position.

P's runs are :meth:`~vllm_ascend.distributed.kv_transfer.core.kv_groups.KVGroups.runs` of
the prompt P computed. Everything past this module sees two lists of equal length, D's blocks and P's: the layout
moves a block of each tensor per pair, and a tensor vLLM shares between a layer of each group
holds the KV of the group that owns the block id
(:attr:`~vllm_ascend.distributed.kv_transfer.core.layout.KVCacheLayout.aliases`).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_ascend.distributed.kv_transfer.core.kv_groups import NULL_BLOCK, KVGroups

#: a group's run in P's list: (first position held, blocks held)
Run = tuple[int, int]


def pair_blocks(groups: KVGroups, runs: Sequence[Run], remote_ids: Sequence[int],
                local: Sequence[Sequence[int]], *, computed_tokens: int, total_tokens: int
                ) -> tuple[list[int], list[int]]:
    """D's side: D's blocks and P's, pair by pair, for the positions of every group from D's
    prefix hit (``computed_tokens``) to the last of ``total_tokens`` that D keeps (not null
    in ``local``): a group's positions count its own blocks.

    Args:
        groups: D's KV cache groups (the handshake checks P's are the same).
        runs: P's runs (``KVGroups.runs`` of P's groups).
        remote_ids: P's held block ids (``remote_block_ids``).
        local: D's block ids, one list per group, by position (null where D keeps none).
        computed_tokens: tokens D holds already (its prefix hit, whole blocks).
        total_tokens: tokens D holds once the load is done.

    Raises:
        ValueError: D keeps a position P no longer holds (windows that differ), or the lists
            do not match the groups.
    """
    if len(runs) != len(groups.groups) or len(local) != len(groups.groups):
        raise ValueError(f"P describes {len(runs)} KV cache groups and D has "
                         f"{len(groups.groups)} ({len(local)} block lists)")
    mine: list[int] = []
    theirs: list[int] = []
    offset = 0
    for group, (first, count), ids in zip(groups.groups, runs, local, strict=True):
        bs = group.block_size or 1
        start, end = computed_tokens // bs, -(-total_tokens // bs)
        for pos in range(start, min(end, len(ids))):
            if ids[pos] == NULL_BLOCK:
                continue
            if not first <= pos < first + count:
                raise ValueError(
                    f"D keeps block {pos} of group {group.index} ({group.describe()}) but P "
                    f"holds positions {first} to {first + count - 1}: their windows differ")
            mine.append(int(ids[pos]))
            theirs.append(int(remote_ids[offset + pos - first]))
        offset += count
    return mine, theirs


def predicted_claim(groups: KVGroups, runs: Sequence[Run], remote_ids: Sequence[int], *,
                    computed_tokens: int, total_tokens: int) -> list[int]:
    """P's blocks D will read, before D allocates (the claim sent ahead): of every group, the
    positions from D's prefix hit (``computed_tokens``) that D's manager keeps once
    ``total_tokens`` are computed (:func:`pair_blocks` once D allocated)."""
    out: list[int] = []
    offset = 0
    for group, (first, count) in zip(groups.groups, runs, strict=False):
        bs = group.block_size or 1
        kept = max(computed_tokens // bs, group.first_kept(total_tokens), first)
        last = min(first + count, -(-total_tokens // bs))
        out.extend(int(b) for b in remote_ids[offset + kept - first:offset + max(kept, last) - first])
        offset += count
    return out
