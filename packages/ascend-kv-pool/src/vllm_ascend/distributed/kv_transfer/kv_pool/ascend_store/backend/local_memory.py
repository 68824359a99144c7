# SPDX-License-Identifier: Apache-2.0
"""Host memory of the ``local`` backend: the slabs its objects live in, and their copies.

The embedded backend's slabs, and the copies in and out of them.

:class:`Slabs` hands out slots of one size carved from shared chunks (up to 64 MiB, so the
kernel backs them with huge pages) and keeps freed slots for the next put of that size;
with ``local_pool_prefault`` it carves them from an arena touched at start-up
(:func:`touched_memory`). :class:`Copier` runs a batch of ``memmove`` calls, which release
the GIL, split over threads when the batch is large. :mod:`.local_backend` decides what
goes where.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from vllm_ascend.distributed.kv_transfer.core.device import usable_cpus
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import coalesce

#: Largest slab chunk.
CHUNK_BYTES = 64 << 20
#: Smallest chunk of a size seen twice (numpy asks for huge pages from 4 MiB on).
HUGE_BYTES = 4 << 20
#: Stride of the writes that touch a prefaulted pool (the smallest page size).
PAGE_BYTES = 4096
#: Size of a huge page (x86-64, and arm64 with 4 KiB pages).
HUGE_PAGE_BYTES = 2 << 20
#: Alignment of chunks carved from a prefaulted pool.
ALIGN_BYTES = 64
#: A put or get moving at least this many bytes is split over the copy threads.
PARALLEL_MIN_BYTES = 4 << 20

_memmove = ctypes.memmove


Move = tuple[int, int, int]  # (dst, src, nbytes)
#: A slot of a slab: its address, its size and the chunk it is in (which lives as long as
#: one of its slots is referenced).
Slot = tuple[int, int, np.ndarray]


def move_all(moves: list[Move]) -> None:
    for dst, src, n in moves:
        _memmove(dst, src, n)


def coalesce_moves(moves: list[Move]) -> list[Move]:
    """``moves`` in destination order, each run contiguous on both sides merged into one
    (:func:`~vllm_ascend.distributed.kv_transfer.core.transfer_engine.coalesce`)."""
    if not moves:
        return []
    return list(zip(*coalesce(*zip(*moves, strict=True)), strict=True))


class Copier:
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

    def run(self, moves: list[Move]) -> None:
        moves = coalesce_moves(moves)
        total = sum(m[2] for m in moves)
        if self.threads == 1 or total < PARALLEL_MIN_BYTES:
            move_all(moves)
            return
        shares = split_shares(moves, total, self.threads)
        if len(shares) < 2:
            move_all(moves)
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1,
                                                thread_name_prefix="local-pool-copy")
            pool = self._pool
        futures = []
        for share in shares[1:]:
            try:
                futures.append(pool.submit(move_all, share))
            except RuntimeError:  # closed meanwhile: this share on the caller
                move_all(share)
        try:
            move_all(shares[0])
        finally:
            for future in futures:
                future.result()

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def split_shares(moves: list[Move], total: int, threads: int) -> list[list[Move]]:
    """``moves`` cut into ``threads`` runs of about equal bytes, in order; a move that
    crosses a share's end is split there (a region's run of blocks is one move)."""
    quota = -(-total // threads)
    shares: list[list[Move]] = [[]]
    room = quota
    for dst, src, n in moves:
        while n > room and len(shares) < threads:
            if room:
                shares[-1].append((dst, src, room))
                dst, src, n = dst + room, src + room, n - room
            shares.append([])
            room = quota
        if n:
            shares[-1].append((dst, src, n))
            room -= n
    return [share for share in shares if share]


def prefault_bytes(capacity: int) -> int:
    """Bytes a pool of ``capacity`` touches at start-up with ``local_pool_prefault``: the
    capacity and one chunk (a batch may overshoot the capacity by that much)."""
    return capacity + CHUNK_BYTES


def touched_memory(nbytes: int, threads: int = 1,
                   touched: Callable[[int], None] | None = None) -> np.ndarray:
    """``nbytes`` of host memory with every page touched (written), so no later copy into
    it faults; numpy advises huge pages for it, and it starts on one. ``threads`` threads
    touch a share each (a page fault's cost is mostly the kernel's, which runs on the
    faulting thread's core; on a VM whose host backs guest memory lazily, two threads took
    7 s for 2 GB, one 14-20 s), a chunk at a time, each chunk's bytes then passed to
    ``touched`` (from the thread that touched it).
    """
    nbytes = max(0, nbytes)
    raw = np.empty(nbytes + HUGE_PAGE_BYTES, dtype=np.uint8)
    skip = -raw.ctypes.data % HUGE_PAGE_BYTES  # starts on a huge page
    arena = raw[skip:skip + nbytes]
    threads = max(1, min(threads, arena.nbytes // CHUNK_BYTES))
    share = -(-arena.nbytes // threads)
    share = -(-share // PAGE_BYTES) * PAGE_BYTES

    def touch(start: int) -> None:
        end = min(start + share, arena.nbytes)
        for lo in range(start, end, CHUNK_BYTES):
            hi = min(lo + CHUNK_BYTES, end)
            arena[lo:hi:PAGE_BYTES] = 0  # numpy releases the GIL here
            if touched is not None:
                touched(hi - lo)

    workers = [threading.Thread(target=touch, args=(i * share,), name="local-pool-prefault")
               for i in range(1, threads)]
    for worker in workers:
        worker.start()
    touch(0)
    for worker in workers:
        worker.join()
    return arena


class Slabs:
    """Slots of one size carved from shared chunks, with a free list per size.

    Args:
        capacity: the pool's capacity; free slots beyond an eighth of it are let go.
        prefault: touch the pool's memory now (an arena of ``capacity`` bytes and one
            chunk, with ``threads`` threads) and carve chunks from it while it lasts; its
            slots are always kept for reuse, as letting them go would free nothing.
        touched: called with the bytes of each chunk of that memory once touched.
    """

    def __init__(self, capacity: int, prefault: bool = False, threads: int = 1,
                 touched: Callable[[int], None] | None = None) -> None:
        self._free: dict[int, list[Slot]] = {}
        self._grown: dict[int, int] = {}  # slots allocated per size so far
        self._free_bytes = 0
        self._max_free = max(capacity // 8, CHUNK_BYTES)
        self._max_slots = max(1, capacity)
        self._arena: np.ndarray | None = None
        self._arena_used = self._arena_lo = self._arena_hi = 0
        if prefault:
            self._arena = touched_memory(prefault_bytes(capacity), threads, touched)
            self._arena_lo = int(self._arena.ctypes.data)
            self._arena_hi = self._arena_lo + self._arena.nbytes

    @property
    def arena_bytes(self) -> int:
        """Bytes touched at start-up (0 without ``prefault``)."""
        return self._arena_hi - self._arena_lo

    def _chunk(self, nbytes: int) -> np.ndarray:
        """A new chunk: from the arena while it has room, else fresh memory."""
        arena = self._arena  # starts on a huge page, so offsets align as addresses do
        if arena is not None:
            start = -(-self._arena_used // ALIGN_BYTES) * ALIGN_BYTES
            if start + nbytes <= arena.nbytes:
                self._arena_used = start + nbytes
                return arena[start:start + nbytes]
        return np.empty(nbytes, dtype=np.uint8)

    def alloc(self, size: int, count: int = 1) -> list[Slot]:
        """``count`` slots of ``size`` bytes: free slots first, then new chunks.

        A chunk holds what the call still needs, at least what the size has grown to
        so far and 4 MiB, at most 64 MiB: a batch put of many blocks faults in a few
        large chunks (huge pages) rather than a doubling series of small ones (about 5%
        slower into an empty pool). A size first seen alone costs one slot.
        """
        out: list[Slot] = []
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
            chunk = self._chunk(slots * size)
            base = int(chunk.ctypes.data)
            views = [(base + i * size, size, chunk) for i in range(slots)]
            take = min(need, slots)
            out.extend(views[:take])
            if slots > take:
                self._free.setdefault(size, []).extend(views[take:])
                self._free_bytes += (slots - take) * size
        return out

    def release(self, slot: Slot) -> None:
        size = slot[1]
        if self._free_bytes + size > self._max_free and not (
                self._arena_lo <= slot[0] < self._arena_hi):
            return  # dropped: the chunk goes once none of its slots is referenced
        self._free.setdefault(size, []).append(slot)
        self._free_bytes += size

    def clear(self) -> None:
        """Forget every slot; the arena goes too (a slot still being read keeps it)."""
        self._free.clear()
        self._grown.clear()
        self._free_bytes = 0
        self._arena = None
        self._arena_used = self._arena_lo = self._arena_hi = 0
