# SPDX-License-Identifier: Apache-2.0
"""Layerwise mode (``MooncakeLayerwiseConnector``): D first, then P, which pushes the KV.

The request goes to a D instance first, with ``kv_transfer_params={"do_remote_prefill":
true, "metaserver": <this proxy>/v1/metaserver, "request_id": <id>}``. Once D has allocated
blocks it POSTs them to ``/v1/metaserver``; the proxy then sends the request to a P instance
with what D posted as its ``kv_transfer_params`` and ``max_tokens=1``, and P pushes the KV
into D's blocks while it prefills. D's answer is the client's. When P fails, the D request
is cancelled (D frees its blocks) and the client gets the error.

A request marked virtual (a ``"do_virtual": true`` body field,
``kv_transfer_params.do_virtual``, or an ``X-KV-Virtual: true`` header) goes to D with
``do_virtual``: D posts nothing and no P is involved (warm-up, testing). ``/status`` lists
the recent requests with whether D posted them and what P answered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .. import signed_params
from .model import ProxyError, error_response, prefill_body, truthy
from .routing import RouteRequest

if TYPE_CHECKING:
    from .instances import InstanceSet
    from .metrics import Metrics
    from .routing import PrefillRouting
    from .upstream import Upstream

logger = logging.getLogger(__name__)

#: Header that marks a request virtual in layerwise mode.
VIRTUAL_HEADER = "x-kv-virtual"
#: How many finished requests ``/status`` lists.
HISTORY = 256


@dataclass
class LayerwiseRequest:
    """A layerwise request between the client, D and (once D posted) P."""

    request_id: str
    #: what the policy routes by (kv_aware: its prompt's tokens, fetched while D allocates)
    route: RouteRequest
    headers: dict[str, str]
    virtual: bool
    #: set with the reason when the prefill step failed
    failed: asyncio.Future[str]
    prefill: asyncio.Task[None] | None = None
    record: dict[str, Any] = field(default_factory=dict)


class LayerwiseFlow:
    """The layerwise requests: D's call, the metaserver posts, and P's prefill.

    Args:
        routing: the P order of a request.
        decode: the D instances.
        upstream: the calls to P and D.
        metrics: the stage times.
        metaserver_url: this proxy's ``/v1/metaserver`` as D reaches it.
    """

    def __init__(self, routing: PrefillRouting, decode: InstanceSet, upstream: Upstream,
                 metrics: Metrics, metaserver_url: str | None) -> None:
        self.routing = routing
        self.prefill = routing.prefill
        self.decode = decode
        self.upstream = upstream
        self.metrics = metrics
        self.metaserver_url = metaserver_url
        self.records: dict[str, int] = {"virtual": 0, "metaserver_posts": 0,
                                        "prefill_dispatched": 0, "prefill_failures": 0}
        #: requests waiting for D's metaserver post or in flight
        self.pending: dict[str, LayerwiseRequest] = {}
        #: the records of the last finished requests
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self._tasks: set[asyncio.Task[None]] = set()

    def cancel(self) -> None:
        """The proxy stops: cancel the prefills in flight."""
        for t in list(self._tasks):
            t.cancel()

    async def handle(self, path: str, body: dict[str, Any], headers: dict[str, str],
                     client_headers: Any, *, stream: bool, request_id: str) -> Response:
        """D first; P once D posted its blocks to the metaserver (see the module docstring)."""
        body = dict(body)
        client_kv = body.pop("kv_transfer_params", None)
        virtual = (truthy(body.pop("do_virtual", False))
                   or truthy(client_headers.get(VIRTUAL_HEADER, ""))
                   or (isinstance(client_kv, dict) and truthy(client_kv.get("do_virtual"))))
        kv: dict[str, Any] = {"do_remote_decode": False, "do_remote_prefill": True,
                              "metaserver": self.metaserver_url, "request_id": request_id}
        if virtual:
            kv["do_virtual"] = True
            self.records["virtual"] += 1
        # with a deployment key D posts (its bearer token) only where params we MACed say
        signed_params.sign(kv, ttl_s=signed_params.PROXY_TTL_S)
        d_body = {**body, "kv_transfer_params": kv}
        loop = asyncio.get_running_loop()
        entry = LayerwiseRequest(request_id, RouteRequest(path, body, self.upstream.client),
                                 headers, virtual, loop.create_future(),
                                 record={"request_id": request_id, "virtual": virtual,
                                         "metaserver_post": False, "prefill": None})
        self.pending[request_id] = entry
        if not virtual:
            self.routing.prepare(entry.route)
        start = time.perf_counter()
        try:
            opener = self.upstream.open_stream if stream else self.upstream.post_json
            d_call = asyncio.ensure_future(opener(self.decode, path, d_body, headers))
            waits: set[asyncio.Future[Any]] = {d_call, entry.failed}
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if d_call not in done:
                d_call.cancel()  # closes the connection: D aborts the request, frees its blocks
                with contextlib.suppress(asyncio.CancelledError, ProxyError, httpx.HTTPError):
                    result = await d_call
                    if stream:
                        await result[1].aclose()
                raise ProxyError(502, f"prefill failed: {entry.failed.result()}",
                                 "prefill_error")
            inst, resp = d_call.result()
        except BaseException:
            self._finish(entry)
            raise
        if not stream:
            self.metrics.stage.labels("decode").observe(time.perf_counter() - start)
            self._finish(entry)
            return Response(content=resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"),
                            headers={"X-Request-Id": request_id})
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            self._finish(entry)
            return Response(content=content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))
        self.decode.begin(inst)

        async def relay() -> AsyncIterator[bytes]:
            ok = False

            async def close_on_failure() -> None:
                await asyncio.shield(entry.failed)
                await resp.aclose()

            watcher = asyncio.create_task(close_on_failure())
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
                ok = True
            except httpx.HTTPError:
                ok = False
            finally:
                watcher.cancel()
                await resp.aclose()
                self.decode.end(inst, ok=ok, error="" if ok else "stream interrupted")
                self.metrics.stage.labels("decode").observe(time.perf_counter() - start)
                self._finish(entry)

        return StreamingResponse(relay(), status_code=200,
                                 media_type=resp.headers.get("content-type",
                                                             "text/event-stream"),
                                 headers={"X-Request-Id": request_id})

    def _finish(self, entry: LayerwiseRequest) -> None:
        entry.route.cancel()
        if self.pending.pop(entry.request_id, None) is not None:
            self.history.append(entry.record)

    async def metaserver_post(self, params: dict[str, Any]) -> Response:
        """D's blocks of a pending request: send the request to P with them."""
        rid = params.get("request_id")
        entry = self.pending.get(rid) if isinstance(rid, str) else None
        if entry is None:
            return error_response(404, f"no pending layerwise request {rid!r}",
                                  "unknown_request")
        self.records["metaserver_posts"] += 1
        entry.record["metaserver_post"] = True
        if entry.prefill is not None:
            return JSONResponse({"status": "duplicate"})  # D retried: P already has it
        p_body = prefill_body(entry.route.body, params)
        entry.prefill = asyncio.create_task(self._prefill(entry, p_body))
        self._tasks.add(entry.prefill)
        entry.prefill.add_done_callback(self._tasks.discard)
        return JSONResponse({"status": "ok"})

    async def _prefill(self, entry: LayerwiseRequest, p_body: dict[str, Any]) -> None:
        self.records["prefill_dispatched"] += 1
        start = time.perf_counter()
        path = entry.route.path
        try:
            route = await self.routing.route(entry.route)
            inst, resp = await self.upstream.post_json(self.prefill, path, p_body,
                                                       entry.headers, route.order)
        except ProxyError as exc:
            reason = str(exc)
        else:
            self.metrics.stage.labels("prefill").observe(time.perf_counter() - start)
            self.routing.observe(route, inst, resp)
            entry.record["prefill"] = resp.status_code
            if resp.status_code == 200:
                return
            reason = f"prefill instance {inst.url} answered {resp.status_code}: {resp.text[:500]}"
        self.records["prefill_failures"] += 1
        entry.record["prefill"] = reason
        logger.warning("layerwise request %s: %s", entry.request_id, reason)
        if not entry.failed.done():
            entry.failed.set_result(reason)
