# SPDX-License-Identifier: Apache-2.0
"""Eviction policies of the ``local`` backend (and of ``bench trace``'s replay).

A policy only orders keys; the backend owns the bytes. The backend calls, under
its lock:

* :meth:`EvictionPolicy.insert` when it stores a key (with the key's *parent*,
  the block before it in its hash chain, when known),
* :meth:`EvictionPolicy.access` when a stored key is looked up or read,
* :meth:`EvictionPolicy.remove` when a key is dropped on request,
* :meth:`EvictionPolicy.victim` while it holds more than its capacity: the policy
  picks a key that is not *pinned* (being read), forgets it and returns it.

Policies, by the name of the ``eviction_policy`` option:

``lru``
    Least recently used.
``prefix``
    Prefix-aware LRU, the default: only *leaves* (keys none of whose children
    are stored) are evicted, least recently used first. A pool block is a hit
    only when every block before it is a hit too, so a parent outlives its
    children. On the Mooncake conversation trace it matches LRU (0.991 of an
    unbounded pool at half capacity, 0.965 at a quarter) where the S3-FIFO
    variants fall behind at a quarter (0.91); they lead on one-off scans.
``s3fifo``
    S3-FIFO (Yang et al., SOSP'23): new keys enter a small FIFO (10% of the
    capacity); a key read again before it leaves moves to the main FIFO, one
    that is not goes to a ghost list (keys only), and a ghost key stored again
    enters the main FIFO directly. One-off scans pass through the small FIFO
    without displacing the reused blocks.
``prefix-s3fifo``
    S3-FIFO in which a key with stored children counts as read: scan resistant
    and prefix-aware.

:class:`BeladyOracle` is not selectable: it knows the future (the replay feeds it
the trace) and gives the offline optimum the policies are compared with.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Container, Iterable
from typing import ClassVar

logger = logging.getLogger(__name__)

#: Default of the ``eviction_policy`` option.
DEFAULT_POLICY = "prefix"


class EvictionPolicy(ABC):
    """Decides which stored key goes first; not thread-safe (the backend locks).

    Args:
        capacity: bytes the backend keeps at most (policies that size queues use it).
    """

    name: ClassVar[str] = ""
    #: ``insert`` uses the ``parent`` argument (the backend learns chains only then).
    uses_parents: ClassVar[bool] = False

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)

    @abstractmethod
    def insert(self, key: str, nbytes: int, parent: str | None = None) -> None:
        """``key`` (``nbytes`` bytes, block after ``parent`` in its chain) was stored."""

    @abstractmethod
    def access(self, key: str) -> None:
        """Stored ``key`` was looked up or read."""

    @abstractmethod
    def remove(self, key: str) -> None:
        """Stored ``key`` was dropped on request (not by :meth:`victim`)."""

    @abstractmethod
    def victim(self, pinned: Container[str] = ()) -> str | None:
        """Pick, forget and return the next key to evict, never one in ``pinned``.

        ``None`` when every stored key is pinned (or none is stored).
        """

    @abstractmethod
    def __len__(self) -> int:
        """Keys tracked."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} keys)"


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name: ClassVar[str] = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[str, None] = OrderedDict()

    def insert(self, key: str, nbytes: int, parent: str | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victim(self, pinned: Container[str] = ()) -> str | None:
        for key in self._order:
            if key not in pinned:
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


class _Chains:
    """Parent links and counts of stored children (shared by the prefix-aware policies)."""

    def __init__(self) -> None:
        self.parent: dict[str, str | None] = {}
        self.kids: dict[str, int] = {}  # stored children of a key (stored itself or not)

    def add(self, key: str, parent: str | None) -> str | None:
        """Link ``key``; returns the parent whose child count went from 0 to 1."""
        if parent == key:
            parent = None
        self.parent[key] = parent
        if parent is None:
            return None
        n = self.kids.get(parent, 0)
        self.kids[parent] = n + 1
        return parent if n == 0 else None

    def drop(self, key: str) -> str | None:
        """Unlink ``key``; returns its parent when that parent has no stored child left."""
        parent = self.parent.pop(key, None)
        if parent is None:
            return None
        n = self.kids.get(parent, 0) - 1
        if n > 0:
            self.kids[parent] = n
            return None
        self.kids.pop(parent, None)
        return parent

    def has_kids(self, key: str) -> bool:
        return key in self.kids


class PrefixLRUPolicy(EvictionPolicy):
    """LRU over leaves: a key with stored children is never evicted before them."""

    name: ClassVar[str] = "prefix"
    uses_parents: ClassVar[bool] = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._tick = 0
        self._last: dict[str, int] = {}
        self._chains = _Chains()
        self._leaves: list[tuple[int, str]] = []  # lazy heap of (last use, key)

    def _push(self, key: str) -> None:
        if not self._chains.has_kids(key):
            heapq.heappush(self._leaves, (self._last[key], key))

    def insert(self, key: str, nbytes: int, parent: str | None = None) -> None:
        self._tick += 1
        if key in self._last:
            self._chains.drop(key)
        self._last[key] = self._tick
        self._chains.add(key, parent)  # the parent, a leaf no more, stays in the heap: lazy
        self._push(key)
        if len(self._leaves) > 4 * len(self._last) + 64:
            self._leaves = [(t, k) for k, t in self._last.items()
                            if not self._chains.has_kids(k)]
            heapq.heapify(self._leaves)

    def access(self, key: str) -> None:
        if key in self._last:
            self._tick += 1
            self._last[key] = self._tick
            self._push(key)

    def _forget(self, key: str) -> None:
        del self._last[key]
        parent = self._chains.drop(key)
        if parent is not None and parent in self._last:
            self._push(parent)  # its last child left: a leaf again

    def remove(self, key: str) -> None:
        if key in self._last:
            self._forget(key)

    def victim(self, pinned: Container[str] = ()) -> str | None:
        skipped: list[tuple[int, str]] = []
        found = None
        while self._leaves:
            tick, key = heapq.heappop(self._leaves)
            if self._last.get(key) != tick or self._chains.has_kids(key):
                continue  # stale entry
            if key in pinned:
                skipped.append((tick, key))
                continue
            found = key
            break
        for item in skipped:
            heapq.heappush(self._leaves, item)
        if found is None:
            # no unpinned leaf: links that form a cycle, or every leaf is being read
            found = min((k for k in self._last if k not in pinned), key=self._last.__getitem__,
                        default=None)
            if found is None:
                return None
        self._forget(found)
        return found

    def __len__(self) -> int:
        return len(self._last)


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO: small and main FIFOs plus a ghost list; resists one-off scans.

    Args:
        capacity: bytes kept at most.
        small_fraction: share of ``capacity`` for the small FIFO.
    """

    name: ClassVar[str] = "s3fifo"
    #: reads counted per key at most
    MAX_FREQ: ClassVar[int] = 3

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        super().__init__(capacity)
        self.small_limit = max(1, int(capacity * small_fraction))
        self._small: OrderedDict[str, int] = OrderedDict()  # key -> bytes, oldest first
        self._main: OrderedDict[str, int] = OrderedDict()
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._freq: dict[str, int] = {}
        self._small_bytes = 0

    def _hot(self, key: str) -> bool:
        """The key stays: read since it entered its queue."""
        return self._freq.get(key, 0) > 0

    def insert(self, key: str, nbytes: int, parent: str | None = None) -> None:
        if key in self._freq:
            self.remove(key)
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def access(self, key: str) -> None:
        f = self._freq.get(key)
        if f is not None and f < self.MAX_FREQ:
            self._freq[key] = f + 1

    def remove(self, key: str) -> None:
        if self._freq.pop(key, None) is None:
            return
        n = self._small.pop(key, None)
        if n is not None:
            self._small_bytes -= n
        else:
            self._main.pop(key, None)

    def victim(self, pinned: Container[str] = ()) -> str | None:
        # every key is looked at a bounded number of times: hot keys cool down by one per pass
        budget = (self.MAX_FREQ + 2) * (len(self._small) + len(self._main)) + 1
        while budget > 0 and (self._small or self._main):
            budget -= 1
            if self._small and (self._small_bytes > self.small_limit or not self._main):
                key, n = self._small.popitem(last=False)
                self._small_bytes -= n
                if key in pinned or self._hot(key):
                    self._freq[key] = 0
                    self._main[key] = n
                    continue
                self._ghost[key] = None
                while len(self._ghost) > max(len(self._main), 1):
                    self._ghost.popitem(last=False)
                del self._freq[key]
                self._evicted(key)
                return key
            key, n = self._main.popitem(last=False)
            if key in pinned or self._hot(key):
                self._freq[key] = max(0, self._freq[key] - 1)
                self._main[key] = n
                continue
            del self._freq[key]
            self._evicted(key)
            return key
        return None

    def _evicted(self, key: str) -> None:
        """Hook for subclasses: ``key`` left the queues."""

    def __len__(self) -> int:
        return len(self._freq)


class PrefixS3FIFOPolicy(S3FIFOPolicy):
    """S3-FIFO over leaves: a key with stored children waits outside the queues.

    When its last child leaves, the key re-enters the FIFO it came from at the
    eviction end: a cold one goes next (a dead chain peels off from its tip), one
    read since it entered moves on (or goes round), as in S3-FIFO.
    """

    name: ClassVar[str] = "prefix-s3fifo"
    uses_parents: ClassVar[bool] = True

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        super().__init__(capacity, small_fraction)
        self._chains = _Chains()
        # keys with stored children -> (bytes, parked from the small FIFO)
        self._parked: dict[str, tuple[int, bool]] = {}

    def _park(self, key: str) -> None:
        # a key parked from the small FIFO keeps counting toward its share: a chain that
        # came in together (a one-off scan) leaves from there, tip first
        n = self._small.pop(key, None)
        if n is not None:
            self._parked[key] = (n, True)
            return
        n = self._main.pop(key, None)
        if n is not None:
            self._parked[key] = (n, False)

    def _unpark(self, key: str | None) -> None:
        if key is None or key not in self._parked:
            return
        n, small = self._parked.pop(key)
        queue = self._small if small else self._main
        queue[key] = n
        queue.move_to_end(key, last=False)

    def insert(self, key: str, nbytes: int, parent: str | None = None) -> None:
        super().insert(key, nbytes, parent)
        gained = self._chains.add(key, parent)  # a parent with its first stored child
        if gained is not None and gained in self._freq:
            self._park(gained)
        if self._chains.has_kids(key):  # stored again while its children stayed
            self._park(key)

    def remove(self, key: str) -> None:
        if key not in self._freq:
            return
        parked = self._parked.pop(key, None)
        if parked is not None:
            del self._freq[key]
            if parked[1]:
                self._small_bytes -= parked[0]
        else:
            super().remove(key)
        self._unpark(self._chains.drop(key))

    def victim(self, pinned: Container[str] = ()) -> str | None:
        found = super().victim(pinned)
        if found is None:
            # no unpinned leaf: links that form a cycle, or every leaf is being read
            found = next((k for k in self._parked if k not in pinned), None)
            if found is not None:
                self.remove(found)
        return found

    def _evicted(self, key: str) -> None:
        self._unpark(self._chains.drop(key))

    def __len__(self) -> int:
        return len(self._freq)


class BeladyOracle(EvictionPolicy):
    """The offline optimum: evict the key whose next use is furthest away.

    Args:
        capacity: bytes kept at most.
        uses: for every key, the sorted request numbers that use it.

    Set :attr:`now` to the number of the request being served before each request.
    """

    name: ClassVar[str] = "optimum"

    def __init__(self, capacity: int, uses: dict[str, list[int]]) -> None:
        super().__init__(capacity)
        self.uses = uses
        self.now = 0
        self._next: dict[str, int] = {}
        self._heap: list[tuple[int, int, str]] = []  # (-next use, -insertion number, key)
        self._seq = 0

    def _next_use(self, key: str) -> int:
        times = self.uses.get(key, ())
        i = bisect.bisect_right(times, self.now)  # type: ignore[arg-type]
        return times[i] if i < len(times) else 1 << 62

    def _update(self, key: str) -> None:
        nxt = self._next_use(key)
        self._next[key] = nxt
        self._seq += 1
        heapq.heappush(self._heap, (-nxt, -self._seq, key))

    def insert(self, key: str, nbytes: int, parent: str | None = None) -> None:
        self._update(key)

    def access(self, key: str) -> None:
        if key in self._next:
            self._update(key)

    def remove(self, key: str) -> None:
        self._next.pop(key, None)

    def victim(self, pinned: Container[str] = ()) -> str | None:
        skipped = []
        found = None
        while self._heap:
            item = heapq.heappop(self._heap)
            key = item[2]
            if self._next.get(key) != -item[0]:
                continue
            if key in pinned:
                skipped.append(item)
                continue
            found = key
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        if found is not None:
            del self._next[found]
        return found

    def __len__(self) -> int:
        return len(self._next)


#: Selectable policies by name (the ``eviction_policy`` option).
POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, PrefixLRUPolicy, S3FIFOPolicy, PrefixS3FIFOPolicy)}
#: Names of the selectable policies, in the order the docs list them.
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """The policy called ``name`` (case-insensitive) for a pool of ``capacity`` bytes.

    Raises:
        ValueError: no policy has that name (the message lists the names).
    """
    cls = POLICIES.get(str(name).strip().lower())
    if cls is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of "
                         f"{', '.join(POLICY_NAMES)}")
    return cls(capacity)


def uses_by_key(requests: Iterable[list[str]]) -> dict[str, list[int]]:
    """Request numbers using each key, for :class:`BeladyOracle`."""
    out: dict[str, list[int]] = {}
    for i, keys in enumerate(requests):
        for key in keys:
            times = out.setdefault(key, [])
            if not times or times[-1] != i:
                times.append(i)
    return out
