# SPDX-License-Identifier: Apache-2.0
"""The records the pool's scheduler sends its workers (no vLLM needed): transfer jobs.

The vLLM-free half of the pool's contract: :mod:`.store_contract` (the contract
module the workers import) wraps them into vLLM's ``KVConnectorMetadata``.
Kept free of vLLM so the worker side and the benchmarks import without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BlockEventSpec", "TransferJob"]


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
        group: vLLM's KV cache group of the blocks (hybrid KV cache manager on), named in
            their keys; ``None`` with one group.
    """

    req_id: str
    hashes: list[str]
    block_ids: list[int]
    first_block: int
    token_end: int
    is_async: bool = False
    events: BlockEventSpec | None = None
    group: int | None = None

    def __post_init__(self) -> None:
        if len(self.hashes) != len(self.block_ids):
            raise ValueError(f"{self.req_id}: {len(self.hashes)} hashes but "
                             f"{len(self.block_ids)} block ids")
        if self.events is not None and len(self.events.block_hashes) != len(self.hashes):
            raise ValueError(f"{self.req_id}: {len(self.hashes)} hashes but "
                             f"{len(self.events.block_hashes)} event hashes")
