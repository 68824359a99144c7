# SPDX-License-Identifier: Apache-2.0
"""Instances behind the proxy and the policy that picks one."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["round_robin", "least_loaded", "kv_aware"]
#: ``kv_aware`` orders like ``least_loaded`` here; :mod:`.router` reorders the prefill
#: instances by their cached prefix of each request.
POLICIES: tuple[str, ...] = ("round_robin", "least_loaded", "kv_aware")


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

    def as_dict(self) -> dict[str, object]:
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                "in_flight": self.in_flight, "served": self.served, "failures": self.failures,
                "last_error": self.last_error}


class Pool:
    """Instances of one role with a selection policy.

    ``pick`` returns healthy instances in preference order (the caller tries the
    next one when a connection fails); unhealthy instances come last, so a pool
    whose health checks are stale still gets a try rather than an instant 503.

    ``add`` and ``remove`` replace the instance list under the lock (copy on write): a
    reader iterating ``instances`` keeps the list it took; a removed instance's requests
    in flight finish on it.
    """

    def __init__(self, role: str, urls: Iterable[str], policy: Policy = "round_robin") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
        self.role = role
        self.policy = policy
        self.instances = [Instance(u.rstrip("/"), role) for u in urls]
        if not self.instances:
            raise ValueError(f"no {role} instance given")
        self._rr = itertools.count()
        self._lock = threading.Lock()

    def pick(self) -> list[Instance]:
        with self._lock:
            n = len(self.instances)
            start = next(self._rr) % n
            rotated = self.instances[start:] + self.instances[:start]
            if self.policy in ("least_loaded", "kv_aware"):
                rotated.sort(key=lambda i: i.in_flight)  # stable: ties keep round-robin order
            return [i for i in rotated if i.healthy] + [i for i in rotated if not i.healthy]

    def find(self, url: str) -> Instance | None:
        url = url.rstrip("/")
        return next((i for i in self.instances if i.url == url), None)

    def add(self, url: str) -> Instance:
        """Add an instance (healthy until its first health check says otherwise).

        Raises:
            ValueError: it is in the pool already.
        """
        inst = Instance(url.rstrip("/"), self.role)
        with self._lock:
            if any(i.url == inst.url for i in self.instances):
                raise ValueError(f"{inst.url} is already a {self.role} instance")
            self.instances = [*self.instances, inst]
        return inst

    def remove(self, url: str) -> Instance:
        """Take an instance out of the pool.

        Raises:
            KeyError: it is not in the pool.
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
