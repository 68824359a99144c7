# SPDX-License-Identifier: Apache-2.0
"""The pool under vLLM's hybrid KV cache manager: the hit every group serves, the blocks moved.

With the hybrid manager on, a model with full-attention and sliding-window layers has a KV
cache group of each kind (:mod:`vllm_ascend.distributed.kv_transfer.core.kv_groups`), and a
request has one list of block ids per group. The pool keeps a block of each group as an
object of its own (its key names the group), and follows vLLM's rule for hybrid prefix
caching:

* a hit of ``h`` tokens needs, of a full-attention group, every block before ``h``; of a
  sliding-window group, only the blocks vLLM keeps for the window of the token after the
  hit (those wholly before it are vLLM's null block in the request's list);
* so the hit is the longest prefix every group can serve (:func:`hybrid_hit`), and a load
  moves, of a window's group, only the blocks its list holds (:func:`block_runs`);
* a save moves, of a window's group, the blocks vLLM still keeps when it is planned (never a
  null block). vLLM frees a window's blocks while the request runs, not at its end, so a
  block whose save may still be queued can come back in a later step's allocation: the
  scheduler then has the worker wait for that request's saves before the step's forward pass
  (:class:`SavedWindowBlocks`).

No vLLM import: the scheduler and the tests use it with vLLM's values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm_ascend.distributed.kv_transfer.core.kv_groups import NULL_BLOCK, KVGroups

__all__ = ["SavedWindowBlocks", "block_runs", "hybrid_hit"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hybrid_hit(groups: KVGroups, present: Sequence[Sequence[bool]], *, block_size: int,
               token_end: int, num_tokens: int, num_computed: int) -> int:
    """Tokens of the request every group can serve from the pool (local prefix included).

    Args:
        groups: the engine's KV cache groups.
        present: per group (in ``groups`` order), per pool block of the request's hashes
            (the last may cover a partial block, up to ``token_end``): held by the pool.
        block_size: tokens per block (every group's).
        token_end: tokens the hashes cover.
        num_tokens: the request's tokens; a hit never covers the last (it is computed so
            that the next token is sampled).
        num_computed: tokens vLLM has locally (block-aligned, as vLLM's scheduler asks).

    Returns:
        The longest ``h <= num_tokens - 1`` such that every group holds the blocks it needs
        for ``h`` beyond the local ones; ``num_computed`` or less means a miss.
    """
    if len(present) != len(groups.groups):
        raise ValueError(f"{len(present)} presence rows for {len(groups.groups)} groups")
    local_blocks = num_computed // block_size
    num_hashes = min(len(row) for row in present) if present else 0
    for k in range(num_hashes, local_blocks, -1):
        hit = min(k * block_size, token_end, num_tokens - 1)
        if hit <= num_computed:
            return 0
        last = _cdiv(hit, block_size)
        if all(all(row[i] for i in range(max(local_blocks, group.first_kept(hit)), last))
               for group, row in zip(groups.groups, present, strict=True)):
            return hit
    return 0


def block_runs(block_ids: Sequence[int], first: int, last: int
               ) -> list[tuple[int, list[int]]]:
    """The runs of non-null blocks of positions ``first .. last`` of one group's list:
    ``(first position, block ids)`` each (a window's group holds vLLM's null block in place of
    the blocks it freed)."""
    runs: list[tuple[int, list[int]]] = []
    for pos in range(first, min(last, len(block_ids))):
        block = block_ids[pos]
        if block == NULL_BLOCK:
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == pos:
            runs[-1][1].append(block)
        else:
            runs.append((pos, [block]))
    return runs


class SavedWindowBlocks:
    """Blocks of sliding-window groups sent to be saved, and the request that saves them.

    vLLM frees a window's blocks while the request still runs; one may be allocated again
    (to any request, any group) while its save is queued on the worker. :meth:`reused` says
    which requests' saves must be done before a step whose new blocks include such a one.
    Keyed by block id, so it never holds more entries than the KV cache has blocks.
    """

    def __init__(self) -> None:
        self._owner: dict[int, str] = {}

    def saving(self, req_id: str, block_ids: Iterable[int]) -> None:
        """``req_id``'s saves of this step read ``block_ids``."""
        for block in block_ids:
            self._owner[block] = req_id

    def reused(self, new_block_ids: Iterable[int]) -> set[str]:
        """The requests whose saves read any of ``new_block_ids`` (forgotten: a block is
        waited for once)."""
        out: set[str] = set()
        for block in new_block_ids:
            req_id = self._owner.pop(block, None)
            if req_id is not None:
                out.add(req_id)
        return out

    def __len__(self) -> int:
        return len(self._owner)
