# SPDX-License-Identifier: Apache-2.0
"""Pending-transfer tracking: an owner and a deadline for everything held for a peer.

A :class:`LeaseTable` holds entries such as "blocks P keeps for request R until
D has read them" or "request R on D waiting for its KV". Each entry leaves the
table exactly once, either completed (:meth:`LeaseTable.complete`) or expired
(:meth:`LeaseTable.expire`); a completion that arrives after expiry, or twice,
is ignored and counted, never an assertion. A peer that is alive renews its
leases (:meth:`LeaseTable.renew`) so a long wait is not mistaken for a death.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass
class Lease(Generic[V]):
    """One held entry."""

    payload: V
    owner: str
    ttl: float
    expires_at: float
    created_at: float
    renewals: int = 0


@dataclass
class LeaseStats:
    """Counters of a :class:`LeaseTable` (monotonic since creation)."""

    added: int = 0
    completed: int = 0
    expired: int = 0
    renewed: int = 0
    late_completions: int = 0
    dropped: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class LeaseTable(Generic[K, V]):
    """A thread-safe table of leases keyed by ``K``.

    Args:
        default_ttl: lease duration in seconds when :meth:`add` gives none.
        clock: monotonic time source (tests inject a fake one).
        name: used in messages.
    """

    def __init__(self, default_ttl: float, *, clock: Callable[[], float] = time.monotonic,
                 name: str = "leases") -> None:
        if default_ttl <= 0:
            raise ValueError(f"{name}: lease ttl must be positive, got {default_ttl}")
        self.default_ttl = default_ttl
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[K, Lease[V]] = {}
        # deadlines in order, so expiry costs what lapsed rather than what is held: one item
        # per add or renew; an item whose lease left, or was renewed since, is stale and
        # skipped when it comes up (and the heap rebuilt once mostly stale)
        self._deadlines: list[tuple[float, int, K, Lease[V]]] = []
        self._seq = itertools.count()
        self.stats = LeaseStats()

    def _push(self, key: K, lease: Lease[V]) -> None:
        """Record ``lease``'s current deadline (the caller holds the lock)."""
        heap = self._deadlines
        if len(heap) > 64 and len(heap) > 4 * len(self._entries):
            heap[:] = [(le.expires_at, next(self._seq), k, le)
                       for k, le in self._entries.items() if le is not lease]
            heapq.heapify(heap)
        heapq.heappush(heap, (lease.expires_at, next(self._seq), key, lease))

    def _live(self, item: tuple[float, int, K, Lease[V]]) -> bool:
        """Whether a heap item is its key's current lease at its current deadline."""
        deadline, _, key, lease = item
        return self._entries.get(key) is lease and lease.expires_at == deadline

    def add(self, key: K, payload: V, *, owner: str, ttl: float | None = None) -> None:
        """Start holding ``key`` for ``owner`` (the peer or component that must release it,
        and whose death releases it: :meth:`expire_owner`).

        Raises:
            ValueError: ``owner`` is empty (or not a string): nothing is held without an owner.
            KeyError: ``key`` is already held (a request id reused while pending).
        """
        if not isinstance(owner, str) or not owner.strip():
            raise ValueError(f"{self.name}: {key!r} needs an owner (the peer or component "
                             f"that holds it), got {owner!r}")
        ttl = self.default_ttl if ttl is None else ttl
        now = self._clock()
        with self._lock:
            if key in self._entries:
                raise KeyError(f"{self.name}: {key!r} is already pending")
            lease = Lease(payload, owner, ttl, now + ttl, now)
            self._entries[key] = lease
            self._push(key, lease)
            self.stats.added += 1

    def renew(self, key: K, ttl: float | None = None) -> bool:
        """Push the deadline of ``key`` out by its ttl; False if it is not held."""
        now = self._clock()
        with self._lock:
            lease = self._entries.get(key)
            if lease is None:
                return False
            if ttl is not None:
                lease.ttl = ttl
            lease.expires_at = now + lease.ttl
            self._push(key, lease)
            lease.renewals += 1
            self.stats.renewed += 1
            return True

    def complete(self, key: K) -> V | None:
        """Release ``key`` normally and return its payload.

        Returns ``None`` (and counts a late completion) when ``key`` already
        expired, completed, or was never held.
        """
        with self._lock:
            lease = self._entries.pop(key, None)
            if lease is None:
                self.stats.late_completions += 1
                return None
            self.stats.completed += 1
            return lease.payload

    def drop(self, key: K) -> V | None:
        """Remove ``key`` without counting it as completed (e.g. request aborted)."""
        with self._lock:
            lease = self._entries.pop(key, None)
            if lease is not None:
                self.stats.dropped += 1
                return lease.payload
            return None

    def expire(self, now: float | None = None) -> list[tuple[K, V]]:
        """Remove and return every entry whose deadline has passed (each exactly once)."""
        now = self._clock() if now is None else now
        out: list[tuple[K, V]] = []
        with self._lock:
            heap = self._deadlines
            while heap and heap[0][0] <= now:
                item = heapq.heappop(heap)
                if self._live(item):
                    del self._entries[item[2]]
                    out.append((item[2], item[3].payload))
            self.stats.expired += len(out)
            return out

    def expire_owner(self, owner: str) -> list[tuple[K, V]]:
        """Expire every entry of ``owner`` at once (the peer is known dead)."""
        with self._lock:
            due = [k for k, lease in self._entries.items() if lease.owner == owner]
            out = [(k, self._entries.pop(k).payload) for k in due]
            self.stats.expired += len(out)
            return out

    def get(self, key: K) -> V | None:
        """The payload of ``key`` if held, without releasing it."""
        with self._lock:
            lease = self._entries.get(key)
            return None if lease is None else lease.payload

    def lease(self, key: K) -> Lease[V] | None:
        """The lease record of ``key`` (a snapshot reference; do not mutate)."""
        with self._lock:
            return self._entries.get(key)

    def owners(self) -> set[str]:
        """Owners that currently hold at least one entry."""
        with self._lock:
            return {lease.owner for lease in self._entries.values()}

    def keys_of(self, owner: str) -> list[K]:
        """Keys held by ``owner``."""
        with self._lock:
            return [k for k, lease in self._entries.items() if lease.owner == owner]

    def next_deadline(self) -> float | None:
        """The earliest deadline, or ``None`` when empty."""
        with self._lock:
            heap = self._deadlines
            while heap and not self._live(heap[0]):
                heapq.heappop(heap)
            return heap[0][0] if heap else None

    def keys(self) -> list[K]:
        """Snapshot of the held keys."""
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
