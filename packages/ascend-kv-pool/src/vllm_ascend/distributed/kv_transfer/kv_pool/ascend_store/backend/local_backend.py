# SPDX-License-Identifier: Apache-2.0
"""The embedded default backend: host memory of this process, bounded.

Zero configuration: with no ``backend`` key the pool keeps blocks here, up to
``local_pool_size`` bytes (``"8GB"`` by default), evicting by the
``eviction_policy`` option (:mod:`.eviction`; prefix-aware LRU by default,
``lru``, ``s3fifo`` and ``prefix-s3fifo`` selectable). Copies are ``memmove``
calls that release the GIL, so the save and load threads overlap the forward
pass; a put or get of at least 4 MiB is split over ``local_copy_threads``
threads (2 by default), as one core's copy stream leaves memory bandwidth unused.

Memory comes from slabs: objects of one size share chunks (up to 64 MiB, so the
kernel backs them with huge pages), and an evicted object's slot is reused by
the next put of that size, so a full pool writes into memory it already touched
instead of faulting in fresh pages per put. A key being read is *pinned*: no
policy evicts it, and a slot removed while read is recycled only after the read.

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

import ctypes
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np

from vllm_ascend.distributed.kv_transfer.core.device import usable_cpus

from ..config import DEFAULT_COPY_THREADS
from .base import RC_ERROR, Backend
from .eviction import DEFAULT_POLICY, EvictionPolicy, make_policy

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
#: Largest slab chunk.
CHUNK_BYTES = 64 << 20
#: Smallest chunk of a size seen twice (numpy asks for huge pages from 4 MiB on).
HUGE_BYTES = 4 << 20
#: Parent links learned for keys not stored yet, kept at most.
MAX_LEARNED_LINKS = 1 << 17

#: A put or get moving at least this many bytes is split over the copy threads.
PARALLEL_MIN_BYTES = 4 << 20

_memmove = ctypes.memmove


def _move_all(moves: list[tuple[int, int, int]]) -> None:
    for dst, src, n in moves:
        _memmove(dst, src, n)


class _Copier:
    """Runs a batch of ``(dst, src, nbytes)`` moves, split over ``threads`` threads when the
    batch is large: the caller copies one share, pool threads the others (``memmove``
    releases the GIL), and :meth:`run` returns when every share is done.

    Args:
        threads: copy threads in all, the caller's included; 1 copies on the caller only.
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, min(int(threads), usable_cpus()))
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def run(self, moves: list[tuple[int, int, int]]) -> None:
        total = sum(m[2] for m in moves)
        if self.threads == 1 or len(moves) < 2 or total < PARALLEL_MIN_BYTES:
            _move_all(moves)
            return
        shares: list[list[tuple[int, int, int]]] = [[]]
        quota, acc = total / self.threads, 0
        for move in moves:  # contiguous shares of about equal bytes
            if acc >= quota * len(shares) and len(shares) < self.threads:
                shares.append([])
            shares[-1].append(move)
            acc += move[2]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1,
                                                thread_name_prefix="local-pool-copy")
            pool = self._pool
        futures = []
        for share in shares[1:]:
            try:
                futures.append(pool.submit(_move_all, share))
            except RuntimeError:  # closed meanwhile: this share on the caller
                _move_all(share)
        try:
            _move_all(shares[0])
        finally:
            for future in futures:
                future.result()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


class _Slabs:
    """Slots of one size carved from shared chunks, with a free list per size.

    Args:
        capacity: the pool's capacity; free slots beyond an eighth of it are let go.
    """

    def __init__(self, capacity: int) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._grown: dict[int, int] = {}  # slots allocated per size so far
        self._free_bytes = 0
        self._max_free = max(capacity // 8, CHUNK_BYTES)
        self._max_slots = max(1, capacity)

    def alloc(self, size: int, count: int = 1) -> list[np.ndarray]:
        """``count`` slots of ``size`` bytes: free slots first, then new chunks.

        A chunk holds what the call still needs, at least what the size has grown to
        so far and 4 MiB, at most 64 MiB: a batch put of many blocks faults in a few
        large chunks (huge pages) rather than a doubling series of small ones (about 5%
        slower into an empty pool). A size first seen alone costs one slot.
        """
        out: list[np.ndarray] = []
        free = self._free.get(size)
        while free and len(out) < count:
            self._free_bytes -= size
            out.append(free.pop())
        unit = max(size, 1)
        while len(out) < count:
            need = count - len(out)
            grown = self._grown.get(size, 0)
            slots = 1 if grown == 0 and need == 1 else max(need, grown, HUGE_BYTES // unit)
            slots = max(1, min(slots, CHUNK_BYTES // unit, self._max_slots // unit))
            self._grown[size] = grown + slots
            chunk = np.empty(slots * size, dtype=np.uint8)
            views = [chunk[i * size:(i + 1) * size] for i in range(slots)]
            take = min(need, slots)
            out.extend(views[:take])
            if slots > take:
                self._free.setdefault(size, []).extend(views[take:])
                self._free_bytes += (slots - take) * size
        return out

    def release(self, view: np.ndarray) -> None:
        size = view.nbytes
        if self._free_bytes + size > self._max_free:
            return  # dropped: the chunk goes once none of its slots is referenced
        self._free.setdefault(size, []).append(view)
        self._free_bytes += size

    def clear(self) -> None:
        self._free.clear()
        self._grown.clear()
        self._free_bytes = 0


def _group(key: str) -> str:
    """A key without its block hash: keys of one chain share it."""
    head, _, last = key.rpartition("@")
    if len(last) < 8 and last.isdigit() and "@" in head:  # layerwise: ...@{hash}@{layer}
        return head.rpartition("@")[0] + "@" + last
    return head


class LocalBackend(Backend):
    """Bounded pool in this process's memory.

    Evicted and removed keys are reported to the listeners of
    :meth:`add_eviction_listener` (the pool's ``BlockRemoved`` KV cache events).

    Args:
        parallel_config: unused (upstream signature).
        capacity: bytes kept at most; default from ``config.local_pool_size`` or 8 GiB.
        eviction_policy: a policy name (:data:`.eviction.POLICY_NAMES`) or an
            :class:`~.eviction.EvictionPolicy`; default ``config.eviction_policy``,
            else :data:`.eviction.DEFAULT_POLICY`.
        copy_threads: threads a large put or get is copied with; default
            ``config.local_copy_threads``, else :data:`DEFAULT_COPY_THREADS`.
        **kwargs: ``config``, the pool's ``AscendStoreConfig`` (optional), and the
            options of :class:`~.base.Backend`.

    Raises:
        ValueError: a capacity that is not positive or an unknown policy name.
    """

    name: ClassVar[str] = "local"
    shared_across_processes: ClassVar[bool] = False
    host_memory_only: ClassVar[bool] = True

    def __init__(self, parallel_config: Any = None, *, capacity: int | None = None,
                 eviction_policy: str | EvictionPolicy | None = None,
                 copy_threads: int | None = None, **kwargs: Any) -> None:
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
        self._copier = _Copier(copy_threads)
        self._lock = threading.Lock()
        self._objects: dict[str, np.ndarray] = {}  # in the order stored
        self._pins: dict[str, int] = {}  # readers per key
        self._links: dict[str, str] = {}  # learned parents of keys not stored yet
        self._slabs = _Slabs(self.capacity)
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
        # batches of at most 1/16 of the pool: one lock round trip each, little overshoot
        step = max(1, self.capacity // 16)
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
            by_size: dict[int, list[int]] = {}
            for i, t in need:
                by_size.setdefault(t, []).append(i)
            todo = [pair for t, idx in by_size.items()
                    for pair in zip(idx, self._slabs.alloc(t, len(idx)), strict=True)]
            todo.sort(key=lambda pair: pair[0])  # key order: copies and policy as called
        self._notify(evicted)
        moves = []
        for i, value in todo:
            dst = value.ctypes.data
            for addr, n in zip(addrs[i], sizes[i], strict=True):
                moves.append((dst, addr, n))
                dst += n
        self._copier.run(moves)
        with self._lock:
            for i, value in todo:
                key = keys[i]
                if key in objects:  # stored meanwhile by another thread
                    self._used -= value.nbytes
                    self._slabs.release(value)
                    continue
                objects[key] = value
                self.policy.insert(key, value.nbytes, self._links.pop(key, None)
                                   if self._learn else None)

    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self._check_lists(keys, addrs, sizes)
        out = [0] * len(keys)
        reads: list[tuple[int, np.ndarray]] = []
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
            moves = []
            for i, value in reads:
                src = value.ctypes.data
                for addr, n in zip(addrs[i], sizes[i], strict=True):
                    moves.append((addr, src, n))
                    src += n
            self._copier.run(moves)
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
                            self._slabs.release(value)
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
                        self._slabs.release(value)
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
            self._slabs.release(value)
            self.evictions += 1
            evicted.append(key)
        return evicted

    def __repr__(self) -> str:
        return (f"LocalBackend(capacity={self.capacity}, used={self._used}, "
                f"policy={self.policy.name}, copy_threads={self._copier.threads})")
