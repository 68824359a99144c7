# SPDX-License-Identifier: Apache-2.0
"""The proxy's calls to its P and D instances: requests with failover, and health checks.

A request goes to the first instance of an :class:`~.instances.InstanceSet` (in its
policy's order, or an order given) that answers; one that cannot be reached is marked
unhealthy and the next one is tried; when none answers, :class:`~.model.ProxyError` 503
names what failed. Each instance's ``/health`` is probed periodically, unless it answered a
request since the last round (:class:`HealthChecks`).

The client keeps one connection pool per instance (:class:`PerOriginTransport`): httpcore's
pool looks through every connection it holds on each request and each answer's end (and
polls each idle one's socket), so one pool shared by a fleet made every request's cost grow
with the instances behind the proxy.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from .model import ProxyError

if TYPE_CHECKING:
    from .instances import Instance, InstanceSet
    from .metrics import Metrics
    from .routing import RoutingPolicy


#: How long an idle connection to an instance is kept for reuse (seconds). Below the
#: instances' own keep-alive timeout (``vllm serve``'s uvicorn closes an idle connection
#: after 5 s, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``): at httpx's default, also 5 s, a request
#: sent on a connection the instance was closing just then failed with ``ReadError``
#: (seen through the layerwise proxy, a request 7 s after the last on its connection).
KEEPALIVE_EXPIRY_S = 2.0


class PerOriginTransport(httpx.AsyncBaseTransport):
    """An httpx transport holding one connection pool per origin (scheme, host, port),
    each made on its first request with ``limits``: a request's pool work is that of its
    instance's connections, not of every instance's. The pools share one TLS context
    (making one reads the system's certificates: tens of milliseconds).

    Args:
        limits: each origin's pool limits.
    """

    def __init__(self, limits: httpx.Limits) -> None:
        self.limits = limits
        self._ssl: ssl.SSLContext | None = None
        self._pools: dict[tuple[bytes, bytes, int | None], httpx.AsyncHTTPTransport] = {}

    def pool(self, url: httpx.URL) -> httpx.AsyncHTTPTransport:
        """The pool of ``url``'s origin (made on first use)."""
        key = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            if self._ssl is None:
                self._ssl = httpx.create_ssl_context()
            pool = self._pools[key] = httpx.AsyncHTTPTransport(verify=self._ssl,
                                                               limits=self.limits)
        return pool

    @property
    def origins(self) -> int:
        """How many origins have a pool."""
        return len(self._pools)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.pool(request.url).handle_async_request(request)

    async def aclose(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            await pool.aclose()


class Upstream:
    """The HTTP client (open while the proxy runs) and the calls made with it.

    Args:
        timeout_s: how long an instance's answer is waited for.
        metrics: where the calls are counted.
    """

    def __init__(self, timeout_s: float, metrics: Metrics) -> None:
        self.timeout_s = timeout_s
        self.metrics = metrics
        self._client: httpx.AsyncClient | None = None

    def open(self) -> None:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5.0),
                                         transport=PerOriginTransport(limits))

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        """The open client (the proxy is running)."""
        assert self._client is not None, "the proxy is not running"
        return self._client

    async def post_json(self, instances: InstanceSet, path: str, body: dict[str, Any],
                        headers: dict[str, str], order: list[Instance] | None = None
                        ) -> tuple[Instance, httpx.Response]:
        """POST to the first instance of ``instances`` (or of ``order``) that answers;
        raises ProxyError if none does."""
        errors = []
        role = instances.role
        for inst in (order if order is not None else instances.pick()):
            instances.begin(inst)
            self.metrics.in_flight.labels(role, inst.url).inc()
            try:
                resp = await self.client.post(inst.url + path, json=body, headers=headers)
            except httpx.HTTPError as exc:
                msg = f"{inst.url}: {type(exc).__name__}: {exc}"
                errors.append(msg)
                instances.end(inst, ok=False, error=msg)
                instances.mark(inst, False, msg)
                self.metrics.upstream.labels(role, inst.url, "unreachable").inc()
                continue
            except BaseException:  # cancelled (layerwise: P failed): the instance is fine
                instances.end(inst, ok=False, error="cancelled")
                raise
            finally:
                self.metrics.in_flight.labels(role, inst.url).dec()
            instances.end(inst, ok=resp.status_code < 500, error=f"HTTP {resp.status_code}")
            self.metrics.upstream.labels(role, inst.url, str(resp.status_code)).inc()
            return inst, resp
        raise ProxyError(503, f"no {role} instance reachable: " + "; ".join(errors),
                         "service_unavailable")

    async def open_stream(self, instances: InstanceSet, path: str, body: dict[str, Any],
                          headers: dict[str, str]) -> tuple[Instance, httpx.Response]:
        """Like :meth:`post_json` but returns an open streaming response."""
        errors = []
        role = instances.role
        for inst in instances.pick():
            req = self.client.build_request("POST", inst.url + path, json=body,
                                            headers=headers)
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.HTTPError as exc:
                msg = f"{inst.url}: {type(exc).__name__}: {exc}"
                errors.append(msg)
                instances.mark(inst, False, msg)
                self.metrics.upstream.labels(role, inst.url, "unreachable").inc()
                continue
            self.metrics.upstream.labels(role, inst.url, str(resp.status_code)).inc()
            return inst, resp
        raise ProxyError(503, f"no {role} instance reachable: " + "; ".join(errors),
                         "service_unavailable")


class HealthChecks:
    """Probes every instance's ``/health`` each ``interval_s``, side by side (one after
    the other, an instance slow to answer held back every later mark by up to the probe's
    3 s). A P that fails one is told to the policy (it may come back with an empty cache).

    A healthy instance that answered a request (below HTTP 500) since the round before is
    not probed (its answer says as much as ``/health`` would; a connection it refuses marks
    it down at once, :meth:`Upstream.post_json`): under load the probes go to the idle and
    the unhealthy instances only, instead of one per instance each round.

    Args:
        sets: the instance sets probed.
        upstream: whose client probes.
        policy: the proxy's routing policy.
        metrics: where each instance's health is shown.
        interval_s: seconds between rounds.
        after_round: called after each round (the proxy's periodic bookkeeping).
    """

    def __init__(self, sets: Sequence[InstanceSet], upstream: Upstream, policy: RoutingPolicy,
                 metrics: Metrics, interval_s: float, after_round: Callable[[], None]) -> None:
        self.sets = sets
        self.upstream = upstream
        self.policy = policy
        self.metrics = metrics
        self.interval_s = interval_s
        self.after_round = after_round

    async def run(self) -> None:
        """Probe until cancelled."""
        since = float("inf")  # the first round probes every instance
        while True:
            start = time.monotonic()
            await asyncio.gather(*(self.probe(s, inst) for s in self.sets
                                   for inst in s.instances
                                   if not (inst.healthy and inst.last_ok > since)))
            since = start
            self.after_round()
            await asyncio.sleep(self.interval_s)

    async def probe(self, instances: InstanceSet, inst: Instance) -> None:
        """One ``/health`` probe of ``inst``, marked in ``instances``."""
        try:
            r = await self.upstream.client.get(inst.url + "/health", timeout=3.0)
            ok, err = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as exc:
            ok, err = False, f"{type(exc).__name__}: {exc}"
        if not ok and instances.role == "prefill":
            self.policy.instance_down(inst.url)
        instances.mark(inst, ok, "" if ok else err)
        self.metrics.healthy.labels(instances.role, inst.url).set(1 if ok else 0)
