# SPDX-License-Identifier: Apache-2.0
"""The running proxy: its parts wired together.

:class:`Proxy` holds the P and D :class:`~.instances.InstanceSet` s ordered by one routing
policy (:mod:`.policies`), the calls to them and their health checks (:mod:`.upstream`),
and the two request flows, :mod:`.pull_flow` and :mod:`.layerwise_flow`; it sends each
client request to its mode's flow. The FastAPI application around it is :mod:`.app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import Any

from fastapi.responses import Response

from vllm_ascend.distributed.kv_transfer.core import auth

from .instances import InstanceSet
from .layerwise_flow import LayerwiseFlow
from .leases import DecodeLeases
from .metrics import Metrics
from .model import ProxyConfig
from .policies import make_policy
from .pull_flow import PullFlow
from .routing import PrefillRouting
from .upstream import HealthChecks, Upstream


class Proxy:
    """A proxy over ``cfg``'s instances.

    Raises:
        ValueError: ``cfg.policy`` names no policy, or a set has no instance.
    """

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.metrics = Metrics()
        self.policy = make_policy(cfg, self.metrics)
        self.prefill = InstanceSet("prefill", cfg.prefill, self.policy)
        self.decode = InstanceSet("decode", cfg.decode, self.policy)
        #: the deployment key: with one, ``/v1/metaserver`` wants its bearer token
        self.auth = auth.from_env()
        self.upstream = Upstream(cfg.timeout_s, self.metrics)
        #: pull mode: P's leases renewed while D has the request
        self.leases = DecodeLeases(cfg)
        routing = PrefillRouting(self.prefill, self.policy, self.metrics)
        self.pull = PullFlow(routing, self.decode, self.upstream, self.leases, self.metrics,
                             kv_error_fallback=cfg.kv_error_fallback)
        self.layerwise = LayerwiseFlow(routing, self.decode, self.upstream, self.metrics,
                                       cfg.metaserver_url)
        self.health = HealthChecks([self.prefill, self.decode], self.upstream, self.policy,
                                   self.metrics, cfg.health_interval_s, self.leases.expire)
        self.requests = 0
        self._health_task: asyncio.Task[None] | None = None

    def instances(self, role: str) -> InstanceSet:
        """The set of ``role`` (``prefill`` or ``decode``)."""
        return self.prefill if role == "prefill" else self.decode

    @property
    def records(self) -> dict[str, int]:
        """The counts ``/status`` shows."""
        return {"requests": self.requests, **self.layerwise.records, **self.pull.records}

    async def start(self) -> None:
        """Open the client, start the health checks and the policy."""
        self.upstream.open()
        self._health_task = asyncio.create_task(self.health.run())
        self.policy.start(self.prefill.instances)

    async def stop(self) -> None:
        self.policy.stop()
        if self._health_task is not None:
            self._health_task.cancel()
        self.layerwise.cancel()
        if self._health_task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        self.leases.stop()
        await self.upstream.close()

    async def handle(self, path: str, body: dict[str, Any],
                     client_headers: Any = None) -> Response:
        """One client request, under a unique id (sent to P and D as ``X-Request-Id``)."""
        request_id = f"pd-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": request_id}
        self.requests += 1
        stream = bool(body.get("stream"))
        if self.cfg.mode == "layerwise":
            return await self.layerwise.handle(path, body, headers, client_headers or {},
                                               stream=stream, request_id=request_id)
        return await self.pull.handle(path, body, headers, stream=stream,
                                      request_id=request_id)
