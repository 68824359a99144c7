# SPDX-License-Identifier: Apache-2.0
"""The routing policy interface: how the proxy orders the instances it may send a request to.

A policy answers two questions:

* :meth:`RoutingPolicy.order`: every instance of a role (P or D) in preference order, with
  no request at hand. An :class:`~.instances.InstanceSet` asks it on each pick (the D of a
  request, ``/v1/models``, the P order a request-aware policy starts from).
* :meth:`RoutingPolicy.route`: the P instances for one request, refined from that order
  (by default unchanged). Its :class:`Route` names the reason, counted in
  ``vllm_ascend_pd_proxy_routing_decisions{role="prefill", policy, reason}``.

A policy that keeps knowledge of the P instances (``kv_aware``: their prefix caches) also
hears of them coming and going and may start work ahead of a request (:meth:`prepare`); the
hooks do nothing by default. Policies are selected by name (:mod:`.policies`), and
:class:`PrefillRouting` is the one place the proxy's flows ask for a P order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import asyncio

    import httpx

    from .events import EventsEndpoint
    from .instances import Instance, InstanceSet
    from .metrics import Metrics
    from .model import ProxyConfig


@dataclass
class RouteRequest:
    """What a policy may look at in the request it routes to P."""

    #: the client's endpoint (``/v1/completions``, ``/v1/chat/completions``)
    path: str
    #: the client's request body
    body: dict[str, Any]
    #: the proxy's HTTP client, for a policy that asks P (``kv_aware``: ``/tokenize``)
    client: httpx.AsyncClient
    #: work a policy started ahead of the routing (:meth:`RoutingPolicy.prepare`)
    prepared: asyncio.Task[Any] | None = None

    def cancel(self) -> None:
        """The request ended: drop the work started ahead of its routing."""
        if self.prepared is not None:
            self.prepared.cancel()


@dataclass
class Route:
    """The P instances of one request in the order they are tried, and why."""

    order: list[Instance]
    #: the decision's reason (a policy without reasons: its name)
    reason: str
    #: what the policy checks against P's answer (:meth:`RoutingPolicy.observe`)
    decision: object | None = None


class RoutingPolicy(ABC):
    """How the proxy orders P and D instances; one instance serves both roles.

    Subclasses set ``name`` (the ``--policy`` value) and implement :meth:`order`; the
    other methods have defaults. A new policy is one subclass and one line in
    :data:`.policies.POLICIES` (or :func:`.policies.register_policy`).
    """

    #: the name ``--policy`` and ``ProxyConfig.policy`` select it by
    name: ClassVar[str]
    #: the policy follows the P instances' KV events (the ``kv_aware`` options apply)
    follows_kv_events: ClassVar[bool] = False

    @classmethod
    def from_config(cls, cfg: ProxyConfig, metrics: Metrics) -> RoutingPolicy:
        """The policy of a proxy with ``cfg``, counting in ``metrics``."""
        return cls()

    @abstractmethod
    def order(self, instances: list[Instance], turn: int) -> list[Instance]:
        """All of ``instances`` in preference order (the healthy ones are tried first in
        that order, then the others). ``turn`` counts the set's picks so far (round robin
        rotates by it). Called under the set's lock: no I/O."""

    async def route(self, order: list[Instance], request: RouteRequest) -> Route:
        """The P instances for ``request``, from :meth:`order`'s ``order``."""
        return Route(order, self.name)

    # The hooks below do nothing unless a policy needs them (hence not abstract: B027).
    def observe(self, route: Route, chosen: str, answer: httpx.Response) -> None:  # noqa: B027
        """P instance ``chosen`` answered the request routed by ``route``."""

    def prepare(self, request: RouteRequest, instances: Sequence[Instance]) -> None:  # noqa: B027
        """Start work for routing ``request`` later (layerwise: while D allocates); the
        work goes in ``request.prepared``."""

    # ------------------------------------------------------------ P instances
    def start(self, instances: Sequence[Instance]) -> None:  # noqa: B027
        """The proxy starts with these P instances."""

    def stop(self) -> None:  # noqa: B027
        """The proxy stops."""

    def instance_added(self, url: str, events: EventsEndpoint | None) -> None:  # noqa: B027
        """A P instance joined (``events``: its KV events endpoint, if one was given)."""

    def instance_removed(self, url: str) -> None:  # noqa: B027
        """A P instance left."""

    def instance_down(self, url: str) -> None:  # noqa: B027
        """A P instance failed a health check."""

    def instance_status(self, url: str) -> dict[str, Any]:
        """What the policy knows of a P instance, for ``/status`` and ``/admin/instances``."""
        return {}

    def update_gauges(self, metrics: Metrics, instances: Sequence[Instance]) -> None:  # noqa: B027
        """Set the policy's gauges of the P instances (at each ``/metrics`` scrape)."""


class PrefillRouting:
    """The proxy's policy applied to its P instances: the order a request is tried in,
    counted by reason.

    Args:
        prefill: the P instances.
        policy: the proxy's policy.
        metrics: where the decisions are counted.
    """

    def __init__(self, prefill: InstanceSet, policy: RoutingPolicy, metrics: Metrics) -> None:
        self.prefill = prefill
        self.policy = policy
        self.metrics = metrics

    def prepare(self, request: RouteRequest) -> None:
        """Let the policy start work on ``request`` before it is routed."""
        self.policy.prepare(request, self.prefill.instances)

    async def route(self, request: RouteRequest) -> Route:
        """The P instances for ``request``, in the order to try them."""
        route = await self.policy.route(self.prefill.pick(), request)
        self.metrics.decisions.labels("prefill", self.policy.name, route.reason).inc()
        return route

    def observe(self, route: Route, chosen: Instance, answer: httpx.Response) -> None:
        """P instance ``chosen`` answered the request routed by ``route``."""
        self.policy.observe(route, chosen.url, answer)
