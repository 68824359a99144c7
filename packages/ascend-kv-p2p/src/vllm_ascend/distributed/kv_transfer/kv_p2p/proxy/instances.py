# SPDX-License-Identifier: Apache-2.0
"""The P or D instances behind the proxy: their state, and the set of one role's.

An :class:`InstanceSet` keeps its instances' health and load; the order it offers them in
is its :class:`Ordering`'s (a :class:`~.routing.RoutingPolicy`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol


class Ordering(Protocol):
    """What an :class:`InstanceSet` asks its routing policy."""

    def order(self, instances: list[Instance], turn: int) -> list[Instance]:
        """``instances`` (all of them) in preference order; ``turn`` counts the set's picks."""
        ...


@dataclass
class Instance:
    """One vLLM server (P or D)."""

    url: str
    role: str
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    failures: int = 0
    last_error: str = ""
    last_check: float = field(default=0.0)
    #: when it last answered a request below HTTP 500 (``time.monotonic()``; 0: never)
    last_ok: float = field(default=0.0)

    def as_dict(self) -> dict[str, object]:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "in_flight": self.in_flight, "served": self.served, "failures": self.failures,
                "last_error": self.last_error}


class InstanceSet:
    """The instances of one role, offered in their routing policy's order.

    ``pick`` returns the healthy instances in the policy's order (the caller tries the
    next one when a connection fails), then the unhealthy ones, so that a set whose
    health checks are stale still gets a try rather than an instant 503.

    ``add`` and ``remove`` replace the instance list under the lock (copy on write): a
    reader iterating ``instances`` keeps the list it took; a removed instance's requests
    in flight finish on it.
    """

    def __init__(self, role: str, urls: Iterable[str], ordering: Ordering) -> None:
        self.role = role
        self.ordering = ordering
        self.instances = [Instance(u.rstrip("/"), role) for u in urls]
        if not self.instances:
            raise ValueError(f"no {role} instance given")
        self._turns = itertools.count()
        self._lock = threading.Lock()

    def pick(self) -> list[Instance]:
        with self._lock:
            ordered = self.ordering.order(list(self.instances), next(self._turns))
            return [i for i in ordered if i.healthy] + [i for i in ordered if not i.healthy]

    def find(self, url: str) -> Instance | None:
        url = url.rstrip("/")
        return next((i for i in self.instances if i.url == url), None)

    def add(self, url: str) -> Instance:
        """Add an instance (healthy until its first health check says otherwise).

        Raises:
            ValueError: it is in the set already.
        """
        inst = Instance(url.rstrip("/"), self.role)
        with self._lock:
            if any(i.url == inst.url for i in self.instances):
                raise ValueError(f"{inst.url} is already a {self.role} instance")
            self.instances = [*self.instances, inst]
        return inst

    def remove(self, url: str) -> Instance:
        """Take an instance out of the set.

        Raises:
            KeyError: it is not in the set.
            ValueError: it is the last one.
        """
        url = url.rstrip("/")
        with self._lock:
            keep = [i for i in self.instances if i.url != url]
            if len(keep) == len(self.instances):
                raise KeyError(f"{url} is not a {self.role} instance")
            if not keep:
                raise ValueError(f"{url} is the last {self.role} instance")
            gone = next(i for i in self.instances if i.url == url)
            self.instances = keep
        return gone

    def begin(self, inst: Instance) -> None:
        with self._lock:
            inst.in_flight += 1

    def end(self, inst: Instance, *, ok: bool, error: str = "") -> None:
        with self._lock:
            inst.in_flight -= 1
            if ok:
                inst.served += 1
                inst.last_ok = time.monotonic()
            else:
                inst.failures += 1
                inst.last_error = error

    def mark(self, inst: Instance, healthy: bool, error: str = "") -> None:
        with self._lock:
            inst.healthy = healthy
            inst.last_check = time.time()
            if error:
                inst.last_error = error

    def any_healthy(self) -> bool:
        return any(i.healthy for i in self.instances)
