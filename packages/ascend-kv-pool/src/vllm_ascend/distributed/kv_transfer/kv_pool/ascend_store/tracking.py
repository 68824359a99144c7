# SPDX-License-Identifier: Apache-2.0
"""What the pool's scheduler side tracks per request (no vLLM needed).

Never sent to the workers: :mod:`.store_contract` re-exports these under
upstream's names (``LoadSpec`` is :class:`PoolHit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["PoolHit", "RequestTracker"]


@dataclass
class PoolHit:
    """A pool hit found by the scheduler's lookup.

    Attributes:
        vllm_cached_tokens: tokens vLLM already has (local prefix cache).
        kvpool_cached_tokens: tokens the pool holds (one less than the prompt on a full hit).
        can_load: set once vLLM allocated blocks for the hit.
        is_async: the load runs between steps (``load_async``).
        token_end: tokens covered by the hashes the lookup was asked about.
    """

    vllm_cached_tokens: int
    kvpool_cached_tokens: int
    can_load: bool = False
    is_async: bool = False
    token_end: int = 0


@dataclass
class RequestTracker:
    """Scheduler-side state of one request."""

    req_id: str
    #: the request's blocks (of vLLM's first KV cache group)
    block_ids: list[int] = field(default_factory=list)
    #: the request's blocks of every KV cache group (hybrid KV cache manager on; the first
    #: is :attr:`block_ids`)
    group_block_ids: list[list[int]] = field(default_factory=list)
    #: tokens whose blocks are saved (or known to be in the pool)
    num_saved_tokens: int = 0
    #: tokens computed once the current step ends
    num_computed_tokens: int = 0
    #: pool hashes of the prompt's blocks, computed once
    hashes: list[str] = field(default_factory=list)
    hashes_cover: int = 0
    #: blocks allocated for a load that has not been emitted yet (one list per group)
    load_block_ids: list[list[int]] = field(default_factory=list)

    def set_blocks(self, block_ids: Sequence[Sequence[int]] | None) -> None:
        """The request's blocks, one list per KV cache group (vLLM's ``block_ids``)."""
        self.group_block_ids = [list(ids) for ids in block_ids or ()] or [[]]
        self.block_ids = self.group_block_ids[0]

    def add_blocks(self, new_block_ids: Sequence[Sequence[int]] | None) -> None:
        """Blocks vLLM added this step, one list per KV cache group."""
        if not new_block_ids:
            return
        if len(self.group_block_ids) < len(new_block_ids):
            self.group_block_ids += [[] for _ in range(len(new_block_ids)
                                                       - len(self.group_block_ids))]
            self.block_ids = self.group_block_ids[0]
        for ids, new in zip(self.group_block_ids, new_block_ids, strict=False):
            ids.extend(new)
