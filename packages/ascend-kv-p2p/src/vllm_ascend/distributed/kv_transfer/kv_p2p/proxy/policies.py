# SPDX-License-Identifier: Apache-2.0
"""The selectable routing policies, by the name ``--policy`` takes.

``round_robin`` (the default)
    Each instance in turn.
``least_loaded``
    The instance with the fewest requests in flight through this proxy (ties in turn).
``kv_aware``
    For P: the instance holding the longest prefix of the prompt in its prefix cache (or
    its KV pool), traded against load (the scores and the prefix indexes:
    :mod:`.router`); for D: as ``least_loaded``.

A policy is a :class:`~.routing.RoutingPolicy`; adding one is its class and its line in
:data:`POLICIES` (or :func:`register_policy`, e.g. from a test or a plugin).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .router import Decision, KvAwareSettings, KvRouter, prompt_tokens
from .routing import Route, RouteRequest, RoutingPolicy

if TYPE_CHECKING:
    import httpx

    from .events import EventsEndpoint
    from .instances import Instance
    from .metrics import Metrics
    from .model import ProxyConfig


class RoundRobin(RoutingPolicy):
    """Each instance in turn."""

    name = "round_robin"

    def order(self, instances: list[Instance], turn: int) -> list[Instance]:
        start = turn % len(instances)
        return instances[start:] + instances[:start]


class LeastLoaded(RoundRobin):
    """The fewest requests in flight through this proxy first; ties in turn."""

    name = "least_loaded"

    def order(self, instances: list[Instance], turn: int) -> list[Instance]:
        # sorted() is stable: instances as loaded keep the round-robin order
        return sorted(super().order(instances, turn), key=lambda i: i.in_flight)


class KvAware(LeastLoaded):
    """For P, the longest cached prefix of the prompt traded against load
    (:class:`.router.KvRouter` scores); the starting order, and D's, is ``least_loaded``.

    The prompt is tokenized (by a P's ``/tokenize``, unless given as token ids) only when
    some P's prefix index or KV pool's is usable; else load decides without it.
    """

    name = "kv_aware"
    follows_kv_events = True

    def __init__(self, router: KvRouter) -> None:
        self.router = router

    @classmethod
    def from_config(cls, cfg: ProxyConfig, metrics: Metrics) -> KvAware:
        return cls(KvRouter(cfg.kv or KvAwareSettings(), metrics))

    def predicts(self, instances: Sequence[Instance]) -> bool:
        """Whether a hit can be predicted on one of ``instances``: its own cache's index or
        its KV pool's is usable."""
        return any(self.router.usable(i.url) is not None
                   or self.router.pool_usable(i.url) is not None for i in instances)

    def prepare(self, request: RouteRequest, instances: Sequence[Instance]) -> None:
        """Tokenize the prompt now (layerwise: while D allocates, not after it posted)."""
        healthy = [i for i in instances if i.healthy]
        if self.predicts(healthy):
            request.prepared = asyncio.create_task(
                prompt_tokens(request.client, healthy[0].url, request.path, request.body))

    async def route(self, order: list[Instance], request: RouteRequest) -> Route:
        tokens = None
        healthy = [i for i in order if i.healthy] or order
        if self.predicts(healthy):
            tokens = await (request.prepared or prompt_tokens(request.client, healthy[0].url,
                                                              request.path, request.body))
        order, decision = self.router.order(order, tokens)
        return Route(order, decision.reason, decision)

    def observe(self, route: Route, chosen: str, answer: httpx.Response) -> None:
        if isinstance(route.decision, Decision):
            self.router.check(route.decision, chosen, answer)

    def start(self, instances: Sequence[Instance]) -> None:
        for inst in instances:
            self.router.add(inst.url, self.router.settings.events.get(inst.url))

    def stop(self) -> None:
        self.router.stop()

    def instance_added(self, url: str, events: EventsEndpoint | None) -> None:
        self.router.add(url, events)

    def instance_removed(self, url: str) -> None:
        self.router.remove(url)

    def instance_down(self, url: str) -> None:
        self.router.instance_down(url)  # it may come back empty

    def instance_status(self, url: str) -> dict[str, Any]:
        return self.router.status(url)

    def update_gauges(self, metrics: Metrics, instances: Sequence[Instance]) -> None:
        for inst in instances:
            index = self.router.indexes.get(inst.url)
            metrics.index_blocks.labels(inst.url).set(len(index) if index else 0)
            metrics.events_live.labels(inst.url).set(
                1 if self.router.usable(inst.url) is not None else 0)


#: The selectable policies by name, in the order the docs list them.
POLICIES: dict[str, type[RoutingPolicy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    KvAware.name: KvAware,
}


def policy_names() -> tuple[str, ...]:
    """The names of the selectable policies."""
    return tuple(POLICIES)


def register_policy(cls: type[RoutingPolicy]) -> type[RoutingPolicy]:
    """Make ``cls`` selectable by its ``name`` (usable as a class decorator).

    Raises:
        ValueError: another policy has that name.
    """
    if POLICIES.get(cls.name, cls) is not cls:
        raise ValueError(f"a routing policy named {cls.name!r} exists already")
    POLICIES[cls.name] = cls
    return cls


def policy_class(name: str) -> type[RoutingPolicy]:
    """The policy called ``name``.

    Raises:
        ValueError: no policy has that name (the message lists the names).
    """
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown routing policy {name!r}; known policies: "
                         f"{', '.join(POLICIES)}")
    return cls


def make_policy(cfg: ProxyConfig, metrics: Metrics) -> RoutingPolicy:
    """The policy ``cfg.policy`` names, for a proxy with ``cfg``.

    Raises:
        ValueError: no policy has that name.
    """
    return policy_class(cfg.policy).from_config(cfg, metrics)
