# SPDX-License-Identifier: Apache-2.0
"""Host block bookkeeping: allocation, LRU eviction, prefix matching, pins and save jobs.

The host pool holds ``num_blocks`` blocks; block ``i`` of every rank's host
segment belongs to the same logical block. Each block is in exactly one state:

* ``FREE``: unused, on the free heap (lowest ids first, so fresh allocations
  form runs that copy in one piece);
* ``PENDING``: allocated to a save job whose ranks have not all confirmed the
  copy; its hash is reserved (no second save of the same block) but never
  matched, so nobody loads a half-written block;
* ``CACHED``: committed, matchable by its hash. A cached block is either
  pinned (a load is planned from it; ``ref > 0``) or evictable, in LRU order.

A request's blocks form a chain of hashes (each hash covers its whole
prefix), so only a *prefix* of a chain is useful. Chains are touched tail
first, which leaves the head most recently used and makes eviction take
tails before heads.

Pins and save jobs carry leases (:class:`~vllm_ascend.distributed.kv_transfer.core.leases.LeaseTable`):
a pin the scheduler never releases, or a save job a rank never confirms (the
rank died), lapses; the blocks are unpinned or freed, never leaked. This class
is not thread-safe: the metadata server serialises calls.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from vllm_ascend.distributed.kv_transfer.core.leases import LeaseTable

from ..errors import OffloadProtocolError

logger = logging.getLogger(__name__)


class BlockState(enum.IntEnum):
    """Life cycle of one host block."""

    FREE = 0
    PENDING = 1
    CACHED = 2


@dataclass
class SaveJob:
    """Host blocks being written for one request in one step.

    Attributes:
        job_id: unique id (0 when nothing had to be saved).
        positions: indices, in the hashes handed to :meth:`HostBlockManager.start_save`,
            of the blocks to copy.
        block_ids: host block of each position.
        ranks: ranks that must confirm the copy before the blocks are committed.
    """

    job_id: int
    positions: list[int]
    block_ids: list[int]
    ranks: frozenset[int] = frozenset()
    done: set[int] = field(default_factory=set)


@dataclass
class ManagerStats:
    """Counters since creation (monotonic)."""

    evictions: int = 0
    committed_blocks: int = 0
    aborted_blocks: int = 0
    expired_jobs: int = 0
    expired_pins: int = 0
    allocation_failures: int = 0


class HostBlockManager:
    """Bookkeeping of a pool of ``num_blocks`` host blocks.

    Args:
        num_blocks: blocks in the pool.
        save_ttl: seconds a save job may stay unconfirmed before its blocks are freed.
        pin_ttl: seconds a pin may stay unreleased before it lapses.
        clock: monotonic time source (tests inject a fake one).
    """

    def __init__(self, num_blocks: int, *, save_ttl: float = 120.0, pin_ttl: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a host pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self._state = [BlockState.FREE] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._ref = [0] * num_blocks
        self._free = list(range(num_blocks))
        heapq.heapify(self._free)
        self._index: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._jobs: LeaseTable[int, SaveJob] = LeaseTable(save_ttl, clock=clock, name="save jobs")
        self._pins: LeaseTable[str, list[int]] = LeaseTable(pin_ttl, clock=clock, name="pins")
        self._job_ids = itertools.count(1)
        self.stats = ManagerStats()

    # ------------------------------------------------------------------ queries
    def match(self, hashes: Sequence[bytes]) -> int:
        """Number of leading ``hashes`` whose blocks are cached (no side effect)."""
        n = 0
        for h in hashes:
            block = self._index.get(h)
            if block is None or self._state[block] is not BlockState.CACHED:
                break
            n += 1
        return n

    def contains(self, block_hash: bytes) -> bool:
        """True when ``block_hash`` is cached or being saved."""
        return block_hash in self._index

    def block_of(self, block_hash: bytes) -> int | None:
        """Host block holding ``block_hash`` (cached or being saved), or None."""
        return self._index.get(block_hash)

    def state_of(self, block_id: int) -> BlockState:
        """State of one block."""
        return self._state[block_id]

    @property
    def num_free(self) -> int:
        """Blocks on the free heap."""
        return len(self._free)

    @property
    def num_pending(self) -> int:
        """Blocks being saved."""
        return sum(1 for s in self._state if s is BlockState.PENDING)

    @property
    def num_cached(self) -> int:
        """Committed blocks (pinned or evictable)."""
        return sum(1 for s in self._state if s is BlockState.CACHED)

    @property
    def num_evictable(self) -> int:
        """Cached blocks nobody pins."""
        return len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks not free."""
        return self.num_blocks - len(self._free)

    def pending_jobs(self) -> list[int]:
        """Ids of the save jobs not yet committed."""
        return self._jobs.keys()

    def pin_keys(self) -> list[str]:
        """Keys of the pins held."""
        return self._pins.keys()

    # ------------------------------------------------------------------ loads
    def pin(self, key: str, hashes: Sequence[bytes], *, owner: str) -> list[int]:
        """Pin the longest cached prefix of ``hashes`` so that it cannot be evicted.

        Returns the host block ids of that prefix (possibly fewer than asked).

        Raises:
            OffloadProtocolError: ``key`` already holds a pin, or ``owner`` is empty.
        """
        _require_owner(owner)
        if key in self._pins:
            raise OffloadProtocolError(f"pin key {key!r} is already held; unpin it first")
        blocks: list[int] = []
        for h in hashes:
            block = self._index.get(h)
            if block is None or self._state[block] is not BlockState.CACHED:
                break
            blocks.append(block)
        if not blocks:
            return []
        for block in blocks:
            if self._ref[block] == 0:
                self._lru.pop(block, None)
            self._ref[block] += 1
        self._pins.add(key, blocks, owner=owner)
        return list(blocks)

    def unpin(self, key: str) -> int:
        """Release a pin; returns the number of blocks it held (0 if unknown or lapsed)."""
        blocks = self._pins.complete(key)
        if blocks is None:
            return 0
        self._release(blocks)
        return len(blocks)

    def _release(self, blocks: list[int]) -> None:
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] < 0:  # pragma: no cover - would be a bookkeeping bug
                raise AssertionError(f"host block {block} unpinned more often than pinned")
            if self._ref[block] == 0:
                self._lru[block] = None
                self._lru.move_to_end(block)

    # ------------------------------------------------------------------ saves
    def start_save(self, hashes: Sequence[bytes], *, ranks: Iterable[int] = (0,),
                   owner: str) -> SaveJob:
        """Reserve host blocks for the ``hashes`` not already cached or being saved.

        Blocks come from the free heap, then from the least recently used
        evictable blocks. Allocation stops at the first block that finds no
        room: later blocks of the chain would be unreachable without it.
        Cached blocks of the chain are touched first so that they are not
        the ones evicted.

        Returns:
            a :class:`SaveJob`; ``job_id`` 0 and empty lists when nothing is to be copied.

        Raises:
            OffloadProtocolError: ``owner`` is empty (checked before anything is taken).
        """
        _require_owner(owner)
        # Cached blocks of this chain leave the LRU while the rest is allocated, so the
        # chain never evicts its own head, and come back most recently used.
        present = [self._index[h] for h in hashes if h in self._index]
        protected = [b for b in present if b in self._lru]
        for block in protected:
            del self._lru[block]
        positions: list[int] = []
        blocks: list[int] = []
        for pos, h in enumerate(hashes):
            if h in self._index:
                continue
            taken = self._take_block()
            if taken is None:
                self.stats.allocation_failures += 1
                break
            self._state[taken] = BlockState.PENDING
            self._hash[taken] = h
            self._index[h] = taken
            positions.append(pos)
            blocks.append(taken)
        for block in reversed(protected):
            self._lru[block] = None
        if not blocks:
            return SaveJob(0, [], [])
        job = SaveJob(next(self._job_ids), positions, blocks, frozenset(ranks))
        if not job.ranks:
            raise OffloadProtocolError("a save job needs at least one rank to confirm it")
        self._jobs.add(job.job_id, job, owner=owner)
        return job

    def finish_save(self, job_id: int, rank: int) -> bool | None:
        """Record that ``rank`` copied job ``job_id``; commit once every rank has.

        Returns True when this call committed the job, False while ranks are
        still missing, None for an unknown, already committed or expired job
        (a late confirmation is ignored).

        Raises:
            OffloadProtocolError: ``rank`` is not one of the job's ranks.
        """
        job = self._jobs.get(job_id)
        if job is None:
            return None
        if rank not in job.ranks:
            raise OffloadProtocolError(f"rank {rank} is not part of save job {job_id} "
                                       f"(ranks {sorted(job.ranks)})")
        job.done.add(rank)
        if job.done != set(job.ranks):
            self._jobs.renew(job_id)
            return False
        self._jobs.complete(job_id)
        for block in reversed(job.block_ids):
            self._state[block] = BlockState.CACHED
            self._ref[block] = 0
            self._lru[block] = None
            self._lru.move_to_end(block)
        self.stats.committed_blocks += len(job.block_ids)
        return True

    def fail_save(self, job_id: int) -> int:
        """Abandon a save job (a rank could not copy it); returns the blocks freed."""
        job = self._jobs.drop(job_id)
        if job is None:
            return 0
        self._abort(job)
        return len(job.block_ids)

    def _abort(self, job: SaveJob) -> None:
        for block in job.block_ids:
            h = self._hash[block]
            if h is not None:
                self._index.pop(h, None)
            self._hash[block] = None
            self._state[block] = BlockState.FREE
            heapq.heappush(self._free, block)
        self.stats.aborted_blocks += len(job.block_ids)

    # ------------------------------------------------------------------ leases
    def expire(self, now: float | None = None) -> tuple[int, int]:
        """Free the blocks of lapsed save jobs and release lapsed pins.

        Returns ``(jobs expired, pins expired)``.
        """
        jobs = self._jobs.expire(now)
        for job_id, job in jobs:
            logger.warning("save job %d expired before ranks %s confirmed it; freeing its %d "
                           "host blocks", job_id, sorted(job.ranks - job.done), len(job.block_ids))
            self._abort(job)
        pins = self._pins.expire(now)
        for key, blocks in pins:
            logger.warning("pin %r lapsed; releasing %d host blocks", key, len(blocks))
            self._release(blocks)
        self.stats.expired_jobs += len(jobs)
        self.stats.expired_pins += len(pins)
        return len(jobs), len(pins)

    def drop_owner(self, owner: str) -> tuple[int, int]:
        """Release everything ``owner`` holds at once (it is known to be gone)."""
        jobs = self._jobs.expire_owner(owner)
        for _job_id, job in jobs:
            self._abort(job)
        pins = self._pins.expire_owner(owner)
        for _key, blocks in pins:
            self._release(blocks)
        return len(jobs), len(pins)

    def drop_rank(self, rank: int) -> int:
        """Abandon every pending job that still waits for ``rank``; returns the jobs dropped."""
        dropped = 0
        job_ids = self._jobs.keys()  # a snapshot: fail_save removes entries
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is not None and rank in job.ranks and rank not in job.done:
                dropped += 1
                self.fail_save(job_id)
        return dropped

    # ------------------------------------------------------------------ reset
    def reset(self) -> int:
        """Free every evictable cached block (pins and pending saves stay); returns the count."""
        blocks = list(self._lru)
        for block in blocks:
            self._evict(block)
        return len(blocks)

    # ------------------------------------------------------------------ helpers
    def _take_block(self) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        if not self._lru:
            return None
        block = next(iter(self._lru))
        self._evict(block)
        self.stats.evictions += 1
        return heapq.heappop(self._free)

    def _evict(self, block: int) -> None:
        del self._lru[block]
        h = self._hash[block]
        if h is not None:
            self._index.pop(h, None)
        self._hash[block] = None
        self._state[block] = BlockState.FREE
        heapq.heappush(self._free, block)

    def check(self) -> None:
        """Verify every invariant of the bookkeeping; raises ``AssertionError`` on a violation."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free heap twice"
        pinned_refs = [0] * self.num_blocks
        pin_keys, job_ids = self._pins.keys(), self._jobs.keys()
        for key in pin_keys:
            for block in self._pins.get(key) or ():
                pinned_refs[block] += 1
        pending_jobs: dict[int, int] = {}
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            assert job is not None
            for block in job.block_ids:
                assert block not in pending_jobs, f"block {block} belongs to two save jobs"
                pending_jobs[block] = job_id
        for block in range(self.num_blocks):
            state = self._state[block]
            h = self._hash[block]
            in_lru = block in self._lru
            if state is BlockState.FREE:
                assert block in free and h is None and not in_lru and self._ref[block] == 0, \
                    f"free block {block} is inconsistent"
                assert block not in pending_jobs
            elif state is BlockState.PENDING:
                assert block not in free and h is not None and not in_lru, \
                    f"pending block {block} is inconsistent"
                assert self._index.get(h) == block and block in pending_jobs
            else:
                assert block not in free and h is not None and self._index.get(h) == block, \
                    f"cached block {block} is inconsistent"
                assert in_lru == (self._ref[block] == 0)
                assert block not in pending_jobs
            assert self._ref[block] == pinned_refs[block], \
                f"block {block}: ref {self._ref[block]} != pins {pinned_refs[block]}"
        assert len(self._index) == sum(1 for s in self._state if s is not BlockState.FREE)


def _require_owner(owner: str) -> None:
    """Nothing is held without an owner: its death (``drop_owner``) releases what it holds."""
    if not isinstance(owner, str) or not owner.strip():
        raise OffloadProtocolError(f"an owner is required to hold host blocks (the scheduler "
                                   f"that pins or saves them), got {owner!r}")
