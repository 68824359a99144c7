# SPDX-License-Identifier: Apache-2.0
"""Plain records of the pool's plans (no vLLM needed): hits, per-request state, transfer jobs.

:mod:`.config_data` wraps them into vLLM's ``KVConnectorMetadata``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BlockEventSpec", "LoadSpec", "RequestTracker", "TransferJob"]


@dataclass
class LoadSpec:
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


@dataclass
class BlockEventSpec:
    """What a save needs to announce its blocks as vLLM KV cache events.

    Filled by the scheduler only when ``kv_events_config.enable_kv_cache_events``
    is on. The hashes are vLLM's own block hashes (``Request.block_hashes``), so
    a subscriber sees the pool's ``BlockStored`` events under the same hashes as
    the engine's device-cache events.

    Attributes:
        block_hashes: vLLM's hash of each block of the job, aligned with
            :attr:`TransferJob.hashes`; ``None`` where vLLM has none (a partial
            tail block), which gets no event.
        parent_hash: vLLM's hash of the block before the job's first block
            (``None`` for the first block of a prompt).
        token_ids: token ids of the job's span, from its first block to its
            ``token_end``.
        lora_name: the request's LoRA adapter name, if any.
        lora_id: the request's LoRA adapter id, if any.
    """

    block_hashes: list[bytes | None]
    parent_hash: bytes | None = None
    token_ids: list[int] = field(default_factory=list)
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass
class TransferJob:
    """Load or save a run of one request's blocks.

    Attributes:
        req_id: the request.
        hashes: pool hashes of blocks ``first_block .. first_block + len(hashes)``.
        block_ids: the vLLM blocks holding them, aligned with ``hashes``.
        first_block: index of ``hashes[0]`` in the request's block sequence.
        token_end: tokens covered up to the last block (it may be partial).
        is_async: load between steps and report through ``get_finished``.
        events: what announces the saved blocks as KV cache events (saves with
            KV events on only).
    """

    req_id: str
    hashes: list[str]
    block_ids: list[int]
    first_block: int
    token_end: int
    is_async: bool = False
    events: BlockEventSpec | None = None

    def __post_init__(self) -> None:
        if len(self.hashes) != len(self.block_ids):
            raise ValueError(f"{self.req_id}: {len(self.hashes)} hashes but "
                             f"{len(self.block_ids)} block ids")
        if self.events is not None and len(self.events.block_hashes) != len(self.hashes):
            raise ValueError(f"{self.req_id}: {len(self.hashes)} hashes but "
                             f"{len(self.events.block_hashes)} event hashes")
