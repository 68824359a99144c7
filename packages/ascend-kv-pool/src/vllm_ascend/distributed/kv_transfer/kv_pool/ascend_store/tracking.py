# SPDX-License-Identifier: Apache-2.0
"""What the pool's scheduler side tracks per request (no vLLM needed).

Never sent to the workers: :mod:`.store_contract` re-exports these under
upstream's names (``LoadSpec`` is :class:`PoolHit`).
"""

from __future__ import annotations

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
    block_ids: list[int] = field(default_factory=list)
    #: tokens whose blocks are saved (or known to be in the pool)
    num_saved_tokens: int = 0
    #: tokens computed once the current step ends
    num_computed_tokens: int = 0
    #: pool hashes of the prompt's blocks, computed once
    hashes: list[str] = field(default_factory=list)
    hashes_cover: int = 0
    #: blocks allocated for a load that has not been emitted yet
    load_block_ids: list[int] = field(default_factory=list)
