# SPDX-License-Identifier: Apache-2.0
"""Messages between the metadata server, the scheduler and the ranks.

msgspec structs over core's :class:`~vllm_ascend.distributed.kv_transfer.core.wire.Codec`
(upstream pickled them). Block hashes are 32-byte SHA-256 digests; a message
with a hash of another length, a field of the wrong type or an unknown tag is
rejected before any handler sees it.

Ranks: ``RegisterRank`` -> ``GetPool`` (until ``ready``) -> ``Attached``, then
``SaveDone`` for every save job. Scheduler: ``Lookup`` per waiting request,
``Pin`` when a load is planned, one ``PlanStep`` per step (allocates the
step's saves, releases the step's pins).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from vllm_ascend.distributed.kv_transfer.core.wire import Codec, Message

#: A block hash: SHA-256 digest from :func:`core.hashing.chained_block_hashes`.
BlockHash = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
#: Upper bound on the blocks one message may name (a 4M-token context at block size 32).
MAX_BLOCKS = 1 << 17
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
HashList = Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS)]
Name = Annotated[str, msgspec.Meta(max_length=512)]


# ---------------------------------------------------------------------- ranks
class RegisterRank(Message):
    """A rank announces its KV layout (bytes of one block of each of its layers)."""

    rank: NonNegative
    world_size: Positive
    tp_rank: NonNegative = 0
    tp_size: Positive = 1
    pp_rank: NonNegative = 0
    pp_size: Positive = 1
    is_mla: bool = False
    layer_names: Annotated[list[Name], msgspec.Meta(max_length=4096)] = msgspec.field(
        default_factory=list)
    layer_block_bytes: Annotated[list[Positive], msgspec.Meta(max_length=4096)] = msgspec.field(
        default_factory=list)


class GetPool(Message):
    """Where is my segment? Asked until the answer is ``ready``."""

    rank: NonNegative


class PoolInfo(Message):
    """The host pool as one rank sees it."""

    ready: bool
    num_blocks: int = 0
    segment_path: str = ""
    layer_block_bytes: list[int] = msgspec.field(default_factory=list)
    #: MLA: the segment is shared by the TP ranks of the stage; save only your stripe
    shared: bool = False


class Attached(Message):
    """The rank mapped its segment (the server unlinks files once every rank did)."""

    rank: NonNegative


class SaveDone(Message):
    """The rank finished copying these save jobs (``failed``: could not copy them)."""

    rank: NonNegative
    job_ids: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_BLOCKS)] = msgspec.field(
        default_factory=list)
    failed: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_BLOCKS)] = msgspec.field(
        default_factory=list)


class RankGone(Message):
    """The rank shuts down: abandon the save jobs still waiting for it."""

    rank: NonNegative


# ---------------------------------------------------------------------- scheduler
class Lookup(Message):
    """How many leading blocks of this chain are cached?"""

    hashes: HashList


class LookupReply(Message):
    """Answer to :class:`Lookup`."""

    num_blocks: int


class Pin(Message):
    """Pin the cached prefix of ``hashes`` under ``key`` until ``PlanStep`` releases it."""

    key: Name
    hashes: HashList
    owner: Name = ""


class PinReply(Message):
    """Host block ids of the pinned prefix (may be shorter than asked)."""

    block_ids: list[int]


class SaveRequest(msgspec.Struct, kw_only=True):
    """Blocks of one request that became full this step."""

    key: Name
    hashes: HashList


class PlanStep(Message):
    """Allocate this step's saves, then release ``unpin``."""

    saves: Annotated[list[SaveRequest], msgspec.Meta(max_length=65536)] = msgspec.field(
        default_factory=list)
    unpin: Annotated[list[Name], msgspec.Meta(max_length=65536)] = msgspec.field(
        default_factory=list)
    owner: Name = ""


class PlannedSave(msgspec.Struct, kw_only=True):
    """Host blocks allocated for one :class:`SaveRequest` (same order)."""

    key: str
    job_id: int
    positions: list[int]
    block_ids: list[int]


class PlanReply(Message):
    """Answer to :class:`PlanStep`, with pool gauges for the metrics."""

    saves: list[PlannedSave]
    evictions: int = 0
    used_blocks: int = 0
    total_blocks: int = 0
    #: save jobs whose lease lapsed since the previous reply
    expired_saves: int = 0


class Reset(Message):
    """Drop every cached block nobody pins (``reset_prefix_cache(reset_connector=True)``)."""


class ResetReply(Message):
    """Blocks freed by :class:`Reset`."""

    freed: int


class GetStats(Message):
    """Pool occupancy and counters."""


class StatsReply(Message):
    """Answer to :class:`GetStats`."""

    ready: bool
    total_blocks: int = 0
    free_blocks: int = 0
    cached_blocks: int = 0
    pending_blocks: int = 0
    pinned_blocks: int = 0
    evictions: int = 0
    committed_blocks: int = 0
    aborted_blocks: int = 0
    expired_jobs: int = 0
    expired_pins: int = 0
    registered_ranks: list[int] = msgspec.field(default_factory=list)


REQUESTS: tuple[type[Message], ...] = (RegisterRank, GetPool, Attached, SaveDone, RankGone,
                                       Lookup, Pin, PlanStep, Reset, GetStats)
REPLIES: tuple[type[Message], ...] = (PoolInfo, LookupReply, PinReply, PlanReply, ResetReply,
                                      StatsReply)


def make_codec() -> Codec[Message]:
    """The codec every endpoint of the offload protocol uses."""
    return Codec([*REQUESTS, *REPLIES])
