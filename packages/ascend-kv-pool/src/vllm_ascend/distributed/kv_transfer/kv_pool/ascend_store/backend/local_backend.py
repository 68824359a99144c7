# SPDX-License-Identifier: Apache-2.0
"""The embedded default backend: host memory of this process, bounded.

Zero configuration: with no ``backend`` key the pool keeps blocks here, up to
``local_pool_size`` bytes (``"8GB"`` by default), evicting by the
``eviction_policy`` option (:mod:`.eviction`; prefix-aware LRU by default,
``lru``, ``s3fifo`` and ``prefix-s3fifo`` selectable). Copies are ``memmove``
calls that release the GIL, so the save and load threads overlap the forward
pass; a put or get of at least 4 MiB is split over ``local_copy_threads``
threads (2 by default), as one core's copy stream leaves memory bandwidth unused.

Memory comes from slabs: an object keeps each of its ranges (one per KV region: a
block's piece of one layer) in a slot of that range's size, slots of one size share
chunks (up to 64 MiB, so the kernel backs them with huge pages), and an evicted
object's slots are reused by the next put of that size, so a full pool writes into
memory it already touched instead of faulting in fresh pages per put. Until the pool is
full once, its puts fault in fresh pages, which costs the engine throughput (most on a
virtual machine whose host backs guest memory lazily); ``local_pool_prefault`` touches the
whole capacity at start-up instead and carves the chunks from it. A key being read
is *pinned*: no policy evicts it, and a slot removed while read is recycled only after
the read.

The slots of a batch are laid out region by region: the slots that one region's
ranges of consecutive keys go to are adjacent where the memory allows, so a request's
consecutive blocks of a layer move in one ``memmove`` (and back on a hit). glibc
copies a range larger than its non-temporal threshold (a few MiB on many hosts,
derived from the cache size) with stores that bypass the cache, about twice as fast
into memory that is not cached; runs that long get the same stores as a plain copy of
the whole batch would (``bench pool`` with the threshold at 4 MiB, 2 CPUs: a put into a
full pool at 0.64 of a plain copy in 128 KiB pieces, 1.13 in runs; a get 0.92 and 1.52).

The prefix-aware policies need each block's parent. Keys carry no parent, so
the backend learns it from call order: ``exists`` and ``get`` calls list a
request's blocks from its first (the lookup walks the chain from the root), so
in one call the key before a key of the same kind (same model, rank and layer)
is its parent.

The store is per process: with TP > 1 each worker keeps its own heads, and the
lookup (answered by rank 0) sees only rank 0's objects. A rank that evicted a
block the others kept fails that load and vLLM recomputes the block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

from vllm_ascend.distributed.kv_transfer.core.device import (
    available_host_memory,
    total_host_memory,
)
from vllm_ascend.distributed.kv_transfer.core.host_memory import (
    HostMemoryError,
    MemoryClaim,
    claim_host_memory,
)
from vllm_ascend.distributed.kv_transfer.core.ranks import workers_on_host

from ..config import DEFAULT_COPY_THREADS
from .base import RC_ERROR, Backend
from .eviction import DEFAULT_POLICY, EvictionPolicy, make_policy
from .local_memory import CHUNK_BYTES, Copier, Move, Slabs, Slot, prefault_bytes

logger = logging.getLogger(__name__)

#: The object does not exist.
RC_NOT_FOUND = -704
#: The destination ranges do not add up to the stored object's size.
RC_SIZE_MISMATCH = -600
#: The object is larger than the whole pool.
RC_TOO_LARGE = -10

_RC_TEXT = {RC_NOT_FOUND: "object not found", RC_SIZE_MISMATCH: "size mismatch",
            RC_TOO_LARGE: "object larger than local_pool_size", RC_ERROR: "error"}

DEFAULT_CAPACITY = 8 << 30
#: Parent links learned for keys not stored yet, kept at most.
MAX_LEARNED_LINKS = 1 << 17

#: A put is stored in batches of 1/16 of the pool, or of a quarter of a small pool up to
#: this many bytes: a region's run of consecutive blocks is cut at a batch's end.
BATCH_MIN_BYTES = 64 << 20


class _Object:
    """A stored object: its ranges' slots in order, and its size."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: list[Slot]) -> None:
        self.parts = parts
        self.nbytes = sum(size for _addr, size, _chunk in parts)


def _read_moves(reads: list[tuple[_Object, list[int], list[int]]]) -> list[Move]:
    """The moves of a get: each object's bytes, in order, into its destination ranges
    (which may cut them differently from the put)."""
    moves: list[Move] = []
    for value, addrs, sizes in reads:
        parts = iter(value.parts)
        src = left = 0
        for addr, n in zip(addrs, sizes, strict=True):
            while n > 0:
                if left == 0:
                    src, left, _chunk = next(parts)
                step = min(n, left)
                moves.append((addr, src, step))
                addr, src, n, left = addr + step, src + step, n - step, left - step
    return moves


def _group(key: str) -> str:
    """A key without its block hash: keys of one chain share it."""
    head, _, last = key.rpartition("@")
    if len(last) < 8 and last.isdigit() and "@" in head:  # layerwise: ...@{hash}@{layer}
        return head.rpartition("@")[0] + "@" + last
    return head


def _check_prefault(capacity: int, host_workers: int) -> MemoryClaim:
    """Refuse a prefaulted pool the host cannot hold: every worker's on this host more than
    the memory there is in all (race-free while they start side by side, as the total does
    not change), or this worker's more than the memory available now less what the other
    processes of the host are touching at the same time (:mod:`~vllm_ascend.distributed.
    kv_transfer.core.host_memory`). Returns this worker's claim, lowered as it touches.

    Raises:
        ValueError: naming the sizes and what to change.
    """
    need = prefault_bytes(capacity)
    total = total_host_memory()
    if host_workers > 1 and total is not None and need * host_workers > total:
        raise ValueError(
            f"local_pool_prefault: {host_workers} workers on this host keep a pool each: "
            f"{host_workers} x {need >> 20} MiB (local_pool_size and a chunk of "
            f"{CHUNK_BYTES >> 20} MiB) is more than the {total >> 20} MiB of host memory in "
            "all; touching it would get the engine killed. Lower local_pool_size (it is per "
            "worker) or turn local_pool_prefault off.")
    try:
        return claim_host_memory(need, what="local_pool_prefault",
                                 available=available_host_memory)
    except HostMemoryError as exc:
        raise ValueError(
            f"local_pool_prefault: local_pool_size of {capacity >> 20} MiB (and a chunk of "
            f"{CHUNK_BYTES >> 20} MiB) is more than the {exc.available >> 20} MiB of host "
            "memory available" + (f" less the {exc.claimed >> 20} MiB other workers of this "
                                  "host are touching now" if exc.claimed else "") +
            "; touching it would get the engine killed. Lower local_pool_size or turn "
            "local_pool_prefault off.") from exc


class LocalBackend(Backend):
    """Bounded pool in this process's memory.

    Evicted and removed keys are reported to the listeners of
    :meth:`add_eviction_listener` (the pool's ``BlockRemoved`` KV cache events).

    Args:
        parallel_config: vLLM's parallel config (upstream signature): how many workers on
            this host keep a pool each (:func:`~vllm_ascend.distributed.kv_transfer.core.
            ranks.workers_on_host`), for ``prefault``'s check.
        capacity: bytes kept at most; default from ``config.local_pool_size`` or 8 GiB.
        eviction_policy: a policy name (:data:`.eviction.POLICY_NAMES`) or an
            :class:`~.eviction.EvictionPolicy`; default ``config.eviction_policy``,
            else :data:`.eviction.DEFAULT_POLICY`.
        copy_threads: threads a large put or get is copied with; default
            ``config.local_copy_threads``, else :data:`DEFAULT_COPY_THREADS`.
        prefault: touch the whole capacity now (start-up time and resident memory)
            instead of page by page as the pool fills, which is what a filling pool's
            saves cost the engine; default ``config.local_pool_prefault``, else off.
        host_workers: that count, given (default: from ``parallel_config``, else 1).
        **kwargs: ``config``, the pool's ``AscendStoreConfig`` (optional), and the
            options of :class:`~.base.Backend`.

    Raises:
        ValueError: a capacity that is not positive, an unknown policy name, or a
            ``prefault`` of more memory than the host has available, or than it has in all
            for the pools of every worker on it.
    """

    name: ClassVar[str] = "local"
    shared_across_processes: ClassVar[bool] = False
    host_memory_only: ClassVar[bool] = True

    def __init__(self, parallel_config: Any = None, *, capacity: int | None = None,
                 eviction_policy: str | EvictionPolicy | None = None,
                 copy_threads: int | None = None, prefault: bool | None = None,
                 host_workers: int | None = None, **kwargs: Any) -> None:
        config = kwargs.get("config")
        if config is not None:
            kwargs.setdefault("max_batch_keys", config.max_batch_keys)
        super().__init__(parallel_config, **kwargs)
        if capacity is None:
            capacity = config.local_pool_size if config is not None else DEFAULT_CAPACITY
        if capacity <= 0:
            raise ValueError(f"local pool capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        if eviction_policy is None:
            eviction_policy = getattr(config, "eviction_policy", None) or DEFAULT_POLICY
        self.policy = (eviction_policy if isinstance(eviction_policy, EvictionPolicy)
                       else make_policy(eviction_policy, self.capacity))
        self._learn = self.policy.uses_parents
        if copy_threads is None:
            copy_threads = getattr(config, "local_copy_threads", None) or DEFAULT_COPY_THREADS
        self._copier = Copier(copy_threads)
        self._lock = threading.Lock()
        self._objects: dict[str, _Object] = {}  # in the order stored
        self._pins: dict[str, int] = {}  # readers per key
        self._links: dict[str, str] = {}  # learned parents of keys not stored yet
        if prefault is None:
            prefault = bool(getattr(config, "local_pool_prefault", False))
        claim = (_check_prefault(self.capacity, workers_on_host(parallel_config)
                                 if host_workers is None else host_workers)
                 if prefault else None)
        started = time.perf_counter()
        try:
            self._slabs = Slabs(self.capacity, prefault=prefault, threads=self._copier.threads,
                                touched=claim.advance if claim is not None else None)
        finally:
            if claim is not None:
                claim.release()
        if prefault:
            logger.info("local pool: touched %d MiB of host memory in %.2f s (prefault)",
                        self._slabs.arena_bytes >> 20, time.perf_counter() - started)
        self._used = 0
        self.evictions = 0
        self._listeners: list[Callable[[list[str]], None]] = []

    # ------------------------------------------------------------ state
    @property
    def used_bytes(self) -> int:
        """Bytes held now."""
        with self._lock:
            return self._used

    @property
    def copy_threads(self) -> int:
        """Threads a large put or get is copied with."""
        return self._copier.threads

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def stored_keys(self) -> list[str]:
        """Keys held, oldest stored first."""
        with self._lock:
            return list(self._objects)

    # ------------------------------------------------------------ Backend
    def register_buffer(self, ptrs: list[int], lengths: list[int]) -> None:
        """Nothing to register: copies are plain memory moves."""

    def exists(self, keys: list[str]) -> list[int]:
        objects, access = self._objects, self.policy.access
        with self._lock:
            if self._learn:
                self._learn_chain(keys, overwrite=True)
            out = []
            for key in keys:
                if key in objects:
                    access(key)
                    out.append(1)
                else:
                    out.append(0)
            return out

    def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self._check_lists(keys, addrs, sizes)
        out = [0] * len(keys)
        # batches of 1/16 of the pool (a quarter of a pool under 256 MiB, 64 MiB at most):
        # one lock round trip each, little overshoot, and runs of a region long enough
        step = max(1, self.capacity // 16, min(self.capacity // 4, BATCH_MIN_BYTES))
        start = 0
        while start < len(keys):
            end, nbytes = start, 0
            while end < len(keys) and (end == start or nbytes < step):
                nbytes += sum(sizes[end])
                end += 1
            self._put_batch(keys, addrs, sizes, start, end, out)
            start = end
        return out

    def _put_batch(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]],
                   start: int, end: int, out: list[int]) -> None:
        need: list[tuple[int, int]] = []
        objects = self._objects
        with self._lock:
            if self._learn:
                self._learn_chain(keys[start:end], overwrite=False)
            for i in range(start, end):
                key = keys[i]
                if key in objects:
                    # Same key, same content (keys are content hashes): keep the old copy.
                    self.policy.access(key)
                    continue
                total = sum(sizes[i])
                if total > self.capacity:
                    logger.warning("local pool: object %s of %d bytes exceeds local_pool_size "
                                   "%d", key, total, self.capacity)
                    out[i] = RC_TOO_LARGE
                    continue
                need.append((i, total))
            if not need:
                return
            # make room first, so the new objects are written into the evicted slots
            incoming = sum(t for _, t in need)
            evicted = self._evict_locked(incoming)
            self._used += incoming  # reserved
            todo, moves = self._place_locked([i for i, _t in need], addrs, sizes)
        self._notify(evicted)
        self._copier.run(moves)
        with self._lock:
            for i, value in todo:
                key = keys[i]
                if key in objects:  # stored meanwhile by another thread
                    self._used -= value.nbytes
                    self._release(value)
                    continue
                objects[key] = value
                self.policy.insert(key, value.nbytes, self._links.pop(key, None)
                                   if self._learn else None)

    def _place_locked(self, idx: list[int], addrs: list[list[int]],
                      sizes: list[list[int]]) -> tuple[list[tuple[int, _Object]], list[Move]]:
        """Slots for the ranges of the objects ``idx`` (in key order), region by region:
        the slots of one size are handed out in address order to the ranges taken
        range index first, key second, so a region's ranges of consecutive keys go to
        adjacent slots where the memory allows. Returns the objects and the moves that
        fill them (which :func:`.local_memory.coalesce_moves` merges)."""
        by_size: dict[int, list[tuple[int, int]]] = {}  # size -> (range index, i)
        for i in idx:
            for j, n in enumerate(sizes[i]):
                if n > 0:
                    by_size.setdefault(n, []).append((j, i))
        slot: dict[tuple[int, int], Slot] = {}
        for n, ranges in by_size.items():
            ranges.sort()
            slots = self._slabs.alloc(n, len(ranges))
            slots.sort()
            slot.update(zip(ranges, slots, strict=True))
        moves = [(slot[j, i][0], addrs[i][j], n)
                 for n, ranges in by_size.items() for j, i in ranges]
        todo = [(i, _Object([slot[j, i] for j, n in enumerate(sizes[i]) if n > 0]))
                for i in idx]
        return todo, moves

    def _release(self, value: _Object) -> None:
        for part in value.parts:
            self._slabs.release(part)

    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self._check_lists(keys, addrs, sizes)
        out = [0] * len(keys)
        reads: list[tuple[int, _Object]] = []
        objects, pins, access = self._objects, self._pins, self.policy.access
        with self._lock:
            if self._learn:
                self._learn_chain(keys, overwrite=True)
            for i, key in enumerate(keys):
                value = objects.get(key)
                if value is None:
                    out[i] = RC_NOT_FOUND
                    continue
                access(key)
                if sum(sizes[i]) != value.nbytes:
                    out[i] = RC_SIZE_MISMATCH
                    continue
                pins[key] = pins.get(key, 0) + 1
                reads.append((i, value))
        try:
            self._copier.run(_read_moves([(value, addrs[i], sizes[i]) for i, value in reads]))
        finally:
            if reads:
                with self._lock:
                    for i, value in reads:
                        key = keys[i]
                        left = pins[key] - 1
                        if left:
                            pins[key] = left
                            continue
                        del pins[key]
                        if objects.get(key) is not value:  # removed while read: recycle now
                            self._release(value)
        return out

    def remove(self, keys: list[str]) -> int:
        """Drop ``keys``; returns how many were present."""
        gone: list[str] = []
        with self._lock:
            for key in keys:
                value = self._objects.pop(key, None)
                if value is not None:
                    self._used -= value.nbytes
                    self.policy.remove(key)
                    if key not in self._pins:
                        self._release(value)
                    gone.append(key)
        self._notify(gone)
        return len(gone)

    def close(self) -> None:
        self._copier.close()  # a later put or get starts its threads again
        with self._lock:
            for key in list(self._objects):
                self.policy.remove(key)
            self._objects.clear()
            self._links.clear()
            self._slabs.clear()
            self._used = 0

    def describe_rc(self, rc: int) -> str:
        return _RC_TEXT.get(rc, super().describe_rc(rc))

    @classmethod
    def supports_eviction_events(cls) -> bool:
        return True

    def add_eviction_listener(self, listener: Callable[[list[str]], None]) -> None:
        """Call ``listener`` with the keys evicted or removed (outside the store's lock)."""
        self._listeners.append(listener)

    def _notify(self, keys: list[str]) -> None:
        if not keys:
            return
        for listener in list(self._listeners):
            try:
                listener(keys)
            except Exception:  # a listener must never break a put
                logger.warning("local pool: eviction listener failed", exc_info=True)

    def _learn_chain(self, keys: list[str], overwrite: bool) -> None:
        """Remember, for keys not stored, the key before them in ``keys`` (same kind)."""
        links, objects = self._links, self._objects
        last: dict[str, str] = {}
        for key in keys:
            group = _group(key)
            parent = last.get(group)
            last[group] = key
            if parent is None or key in objects or parent == key:
                continue
            if overwrite or key not in links:
                links.pop(key, None)  # re-insert: the newest links are kept longest
                links[key] = parent
        while len(links) > MAX_LEARNED_LINKS:
            del links[next(iter(links))]

    def _evict_locked(self, incoming: int = 0) -> list[str]:
        """Evict until ``incoming`` more bytes fit (or every key left is being read)."""
        evicted = []
        while self._used + incoming > self.capacity and self._objects:
            key = self.policy.victim(self._pins)
            if key is None:  # everything left is being read: evict after the reads
                break
            value = self._objects.pop(key)
            self._used -= value.nbytes
            self._release(value)
            self.evictions += 1
            evicted.append(key)
        return evicted

    def __repr__(self) -> str:
        return (f"LocalBackend(capacity={self.capacity}, used={self._used}, "
                f"policy={self.policy.name}, copy_threads={self._copier.threads})")
